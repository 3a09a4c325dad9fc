"""Static checks of token mixers that are not attention: recurrent, state-space and convolutional layers.

Mixers are found by mechanism, not only by class name: state-space parameters (``A_log``,
``dt_bias``, ``D``, RWKV's ``time_decay`` ...), convolutions with a kernel wider than one over
time, torch's RNNs and class names of known mixer kinds. Such a layer runs tree-exact only
through a kind of the layer registry (:mod:`treepack.trainer.hf.layers`).
"""

from __future__ import annotations

import re

import torch

from treepack.trainer.hf.admission.attention_checks import dispatches_attention
from treepack.trainer.hf.layers import is_handled, registered

__all__ = ["STATE_PARAMS", "patched_classes", "conv_reason", "mixer_reason"]


STATE_PARAMS = frozenset({"A_log", "dt_bias", "D", "A", "time_decay", "time_first", "time_faaaa", "time_maa_x"})


_MIXER_NAME = re.compile(
    r"Mamba|SSM|Ssm|Mixer|Recurren|RWKV|Rwkv|DeltaNet|LinearAttention|ShortConv|Conv|Indexer|LSTM|GRU|"
    r"Retention|Hyena|Scan|Kda|KDA|Gdn|GDN"
)


# Per-token modules whose names look like mixers (GPT-2's Conv1D is a transposed Linear).
_PER_TOKEN = frozenset({"transformers.pytorch_utils.Conv1D"})


def patched_classes() -> frozenset[str]:
    """The class names the registry's kinds patch by exact name."""
    return frozenset(c for layer in registered() for c in layer.classes)


def conv_reason(mod: torch.nn.Module) -> str | None:
    if not isinstance(mod, torch.nn.modules.conv._ConvNd):
        return None
    k = tuple(mod.kernel_size)
    if all(x == 1 for x in k):
        return None
    if isinstance(mod, torch.nn.Conv1d) and mod.groups == mod.in_channels and mod.padding[0] == k[0] - 1:
        return (
            f"depthwise causal Conv1d (kernel {k[0]}, {mod.groups} channels) runs over the whole row, across sequences"
        )
    return f"{type(mod).__name__} with kernel {k} mixes neighbouring tokens of the row"


def mixer_reason(mod: torch.nn.Module) -> str | None:
    """Why ``mod`` looks like a non-attention token mixer (None if it does not)."""
    cls = type(mod)
    if f"{cls.__module__}.{cls.__name__}" in _PER_TOKEN:
        return None
    if isinstance(
        mod,
        (
            torch.nn.RNNBase,
            torch.nn.MultiheadAttention,
            torch.nn.Transformer,
            torch.nn.TransformerEncoderLayer,
            torch.nn.TransformerDecoderLayer,
        ),
    ):
        return f"torch {cls.__name__} mixes tokens of the whole row"
    own = {n for n, _ in mod.named_parameters(recurse=False)}
    state = sorted(own & STATE_PARAMS)
    if state:
        return f"state-space / recurrent parameters {state}: a scan over the whole row"
    convs = [c for c in mod.children() if conv_reason(c)]
    if convs:
        return f"recurrent / convolutional mixer: {conv_reason(convs[0])}"
    if (
        _MIXER_NAME.search(cls.__name__)
        and "Norm" not in cls.__name__
        and not dispatches_attention(cls)
        and not _holds_handled_mixer(mod)
    ):
        return f"class name names a token mixer ({_MIXER_NAME.search(cls.__name__).group(0)}) with no tree-exact path"
    return None


def _holds_handled_mixer(mod: torch.nn.Module) -> bool:
    """A container (e.g. ``JambaMambaDecoderLayer``) whose name matches a mixer but whose mixer is
    a handled descendant: the name says nothing about the container itself, and the walk still
    judges every other child."""
    patches = patched_classes()
    return any(type(m).__name__ in patches or is_handled(m) for m in mod.modules() if m is not mod)
