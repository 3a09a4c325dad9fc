"""The model's own output head, final logit transforms included, for the chunked head.

``packed_forward(..., output="hidden")`` returns the base model's final hidden states and
:meth:`~treepack.trainer.data.packed_batch.PackedBatch.target_logprobs_from_hidden` applies a
head to the scored positions in chunks. The head must be what the causal LM's forward does
after its base model, and several families do more than ``lm_head``:

- Cohere / Cohere2: ``logits * self.logit_scale``;
- Granite (and its MoE / hybrid variants): ``logits / config.logits_scaling``; HyperCLOVA X
  multiplies by the same field instead;
- Falcon-H1: ``logits * config.lm_head_multiplier``;
- Gemma 2 / 3 / 4, VaultGemma, Nanochat, Mistral-Large-4 ...: final soft-capping
  ``cap * tanh(logits / cap)`` (``config.final_logit_softcapping``, or the model's own
  ``logit_softcap`` module);
- ModernBERT-decoder: a prediction head (dense, activation, norm: the model's ``lm_head``)
  before the output embedding (its ``decoder``): a model whose ``lm_head`` is a module other
  than its output embeddings runs it first.

The hidden states are those of the model's decoder stack
(:func:`~treepack.trainer.hf.wrapped.inner_model`: HF's ``base_model``, or the stack itself
where ``base_model`` is the whole model, as in Llama 4's and mllama's causal LMs).

:func:`output_head` builds the head from those fields and then *checks it*: on a short probe
input it must reproduce the model's own logits (unpacked, the model's own attention), else
the call raises naming the class. A family with a transform not listed here is refused,
never silently wrong. The verdict is cached on the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.hf.wrapped import inner_model, unwrap_model

__all__ = ["OutputHead", "output_head"]

_CACHE_ATTR = "_treepack_output_head"
_PROBE_LEN = 6


@dataclass(frozen=True)
class OutputHead:
    """``lm_head`` followed by the model's final logit transforms.

    Attributes:
        lm_head: the output embedding module ([n, d] -> [n, V]).
        transforms: (name, fn) applied in order to the [n, V] logits.
        prediction: a module run on the hidden states before ``lm_head`` ([n, d] -> [n, d]:
            ModernBERT-decoder's prediction head), or None.
    """

    lm_head: torch.nn.Module
    transforms: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = ()
    prediction: torch.nn.Module | None = None

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] hidden states -> [..., V] logits, as the causal LM's forward computes them."""
        x = self.lm_head(hidden if self.prediction is None else self.prediction(hidden))
        for _, fn in self.transforms:
            x = fn(x)
        return x

    @property
    def names(self) -> tuple[str, ...]:
        """The steps beyond the plain projection, in order: ``prediction_head`` first when there
        is one, then the transforms' names (``()`` for a plain projection)."""
        return ("prediction_head",) * (self.prediction is not None) + tuple(n for n, _ in self.transforms)


def _field(hf: Any, name: str) -> Any:
    """``name`` on the model itself (not a submodule), else on its text config, else None."""
    v = hf.__dict__.get(name)
    if v is None and name in getattr(hf, "_parameters", {}):
        v = hf._parameters[name]
    if v is None:
        v = getattr(hf.config.get_text_config(), name, None)
    return None if isinstance(v, torch.nn.Module) else v


def _candidates(hf: Any, lm_head: torch.nn.Module) -> list[OutputHead]:
    """Heads the model's fields suggest, most likely first."""
    pre: list[list[tuple[str, Callable]]] = [[]]
    scale = _field(hf, "logit_scale")
    if scale is not None:
        pre = [[("logit_scale", lambda x, s=scale: x * s)]]
    ls = _field(hf, "logits_scaling")
    if ls is not None and ls != 1:
        pre = [p + [("logits_scaling", lambda x, s=ls: x / s)] for p in pre] + [
            p + [("logits_scaling*", lambda x, s=ls: x * s)] for p in pre
        ]
    for name in ("output_multiplier", "lm_head_multiplier"):
        mult = _field(hf, name)
        if isinstance(mult, (int, float)) and mult != 1:
            pre = [p + [(name, lambda x, m=mult: x * m)] for p in pre]
    module_cap = getattr(hf, "logit_softcap", None)
    cap = _field(hf, "final_logit_softcapping")
    post: list[tuple[str, Callable]] = []
    if isinstance(module_cap, torch.nn.Module):
        post = [("logit_softcap", module_cap)]
    elif cap is not None:
        post = [("final_logit_softcapping", lambda x, c=float(cap): torch.tanh(x / c) * c)]
    prediction = getattr(hf, "lm_head", None)
    if not isinstance(prediction, torch.nn.Module) or prediction is lm_head:
        prediction = None
    return [OutputHead(lm_head, tuple(p + post), prediction) for p in pre]


def _probe(hf: Any, heads: list[OutputHead]) -> OutputHead | None:
    """The first head reproducing the model's own logits on a short input, else None."""
    V = int(hf.config.get_text_config().vocab_size)
    dev = next(hf.parameters()).device
    x = (torch.arange(1, _PROBE_LEN + 1, device=dev) * 7 % V)[None]
    modes = [(m, m.training) for m in hf.modules()]
    hf.eval()  # no dropout in the probe
    try:
        with torch.no_grad():
            want = hf(input_ids=x, use_cache=False).logits
            base = inner_model(hf)(input_ids=x, use_cache=False)
            hidden = base.last_hidden_state if hasattr(base, "last_hidden_state") else base[0]
            for head in heads:
                got = head(hidden)
                if got.shape == want.shape and torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-5):
                    return head
    finally:
        for m, t in modes:
            m.training = t
    return None


def output_head(model: Any, *, verify: bool = True) -> OutputHead:
    """The model's head for :meth:`PackedBatch.target_logprobs_from_hidden`.

    Args:
        model: the HF causal LM, possibly wrapped (DDP, FSDP2, PEFT, accelerate).
        verify: check the head against the model's own forward on a probe (cached);
            False only where that forward cannot run (then the fields alone decide).

    Returns:
        An :class:`OutputHead` ([n, d] -> [n, V] logits, the model's transforms applied).

    Raises:
        RequestError: no output embeddings, or no head built from the known transforms
            reproduces the model's logits (rule ``unsupported_logit_transform``).
    """
    hf = unwrap_model(model)
    cached = hf.__dict__.get(_CACHE_ATTR)
    if cached is not None:
        return cached
    lm_head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if lm_head is None:
        raise RequestError(
            f"{type(hf).__name__} has no output embeddings (lm_head)", path="$.model", rule="unsupported"
        )
    heads = _candidates(hf, lm_head)
    head = _probe(hf, heads) if verify else heads[0]
    if head is None:
        raise RequestError(
            f"{type(hf).__name__} post-processes its logits in a way treepack's head does not reproduce "
            f"(tried {[h.names for h in heads]}); use packed_forward(..., output='logits')",
            path="$.model",
            rule="unsupported_logit_transform",
        )
    hf.__dict__[_CACHE_ATTR] = head
    return head
