"""Fail-closed support check: every token mixer of a model is tree-exact, or the call is refused.

:func:`check_model` walks every submodule of an HF model before
:func:`~treepack.trainer.hf.packed_forward` computes anything. A module that mixes tokens
(attention, a recurrent or state-space scan, a convolution over time, a sparse indexer)
must be handled by a tree-exact path, else :class:`~treepack.proto.errors.UnsupportedModelError`
names its path in the model, its class and the reason. Mixers are found by mechanism, not
only by class name:

- attention: a layer whose ``forward`` dispatches through HF's ``AttentionInterface``
  (``ALL_ATTENTION_FUNCTIONS``) runs the tree attention; one that does not (its own
  softmax, ALiBi) is refused, as are the variants the kernels do not run (attention sinks,
  attention dropout while training);
- recurrent / state-space / convolutional layers: state-space parameters (``A_log``,
  ``dt_bias``, ``D``, RWKV's ``time_decay`` ...), convolutions with a kernel wider than one
  over time (the depthwise causal ``Conv1d`` of Mamba, GDN and short-conv layers), torch's
  RNNs, and class names of known mixer kinds. Such a layer is handled only by a kind of the
  layer registry (:mod:`treepack.trainer.hf.layers`): by exact class name, or by mechanism
  when its forward is the code of the kind's stock layer, whatever the class is called; a
  subclass with a forward of its own is refused, as is a conv wider than the plan's
  ``conv_width`` (:func:`~treepack.trainer.kernels.tree_scan.conv_width_refusal`);
- ``config.layer_types``: a layer of a type that is neither attention nor per-token work
  (MLP / MoE) must contain a handled mixer;
- length-dependent RoPE (``dynamic`` NTK, ``longrope``): HF picks the scaling from the
  longest position of the whole call, so one long sequence would change the others'
  rotary embedding. Refused (decision, see the README's model-support section): exact needs every
  sequence's scaling regime in the plan's keys, and a packed row would still need one
  rotary table per sequence, which HF's rotary module does not take;
- MoE auxiliary losses (``output_router_logits``): HF's load-balancing loss averages over
  the positions of the rows, where a shared prefix is one position for all its sharers, so
  it differs from the unpacked batch's; refused;
- logit post-processing (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``):
  applied by the model for ``output="logits"``; refused for ``output="hidden"`` unless the
  caller applies them (``hidden_applies_logit_transforms=True``, which ``packed_forward``
  passes: :func:`~treepack.trainer.hf.head.output_head` applies them).

Vision towers of known VLM classes mix only within one image and run once per distinct
image outside the rows (:mod:`treepack.trainer.hf.vision`); other towers are judged like any
module (their patch convolution and bidirectional attention are refused), and VLMs whose
image tokens attend bidirectionally (Gemma 3) are refused by name.

Dropout while training (anywhere, by module, attribute or config field) and forwards or
hooks patched in from unknown code are refused too (:mod:`treepack.trainer.hf.guards`).

Modules from torch and transformers that work per token (linear layers, norms, embeddings,
MLPs, MoE routers, rotary tables) pass; a module whose ``forward`` is defined elsewhere
(outside torch, transformers, peft, accelerate, treepack) is refused: its code is unknown.
"""

from __future__ import annotations

import functools
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer.hf.guards import dropout_refusals, patch_refusals
from treepack.trainer.hf.layers import handled_layer, is_handled, mixer_kind, registered
from treepack.trainer.hf.vision import vision_refusals, vision_towers
from treepack.trainer.kernels.tree_scan import conv_width_refusal

__all__ = ["check_model", "SupportReport", "Refusal", "ATTENTION_LAYER_TYPES"]

ATTENTION_LAYER_TYPES = frozenset(
    {"full_attention", "sliding_attention", "attention", "global_attention", "local_attention", "chunked_attention"}
)
# Layer types that hold only per-token work (an MLP or MoE block: Nemotron-H's "mlp" / "moe").
# Their modules are still walked, so a token mixer hidden inside one is refused by mechanism.
PER_TOKEN_LAYER_TYPES = frozenset({"mlp", "moe", "ffn", "dense", "feed_forward"})
STATE_PARAMS = frozenset({"A_log", "dt_bias", "D", "A", "time_decay", "time_first", "time_faaaa", "time_maa_x"})
_MIXER_NAME = re.compile(
    r"Mamba|SSM|Ssm|Mixer|Recurren|RWKV|Rwkv|DeltaNet|LinearAttention|ShortConv|Conv|Indexer|LSTM|GRU|Retention|Hyena|Scan|Kda|KDA|Gdn|GDN"
)
_POSITION_NAME = re.compile(r"pos|wpe|rotary|Rotary|Position|ALiBi|alibi", re.I)
_ATTENTION_NAME = re.compile(r"Attention$|Attn$|SelfAttention")
# Per-token modules whose names look like mixers (GPT-2's Conv1D is a transposed Linear).
_PER_TOKEN = frozenset({"transformers.pytorch_utils.Conv1D"})
_KNOWN_PREFIXES = ("torch.", "transformers.", "treepack.", "peft.", "accelerate.")
_LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


@dataclass(frozen=True, slots=True)
class Refusal:
    """One module that has no tree-exact path: ``path`` in the model, ``cls`` its class name, ``reason``."""

    path: str
    cls: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({self.cls}): {self.reason}"


@dataclass(slots=True)
class SupportReport:
    """What :func:`check_model` found.

    Attributes:
        handled: module path -> how it runs on tree rows (``tree_attention``, ``patch:<class>``, ...).
        refusals: the modules (or config settings) with no tree-exact path.
    """

    handled: dict[str, str] = field(default_factory=dict)
    refusals: list[Refusal] = field(default_factory=list)


@functools.cache
def _dispatches_attention(cls: type) -> bool:
    """True when ``cls.forward`` calls HF's attention interface (so the tree attention runs it)."""
    try:
        src = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in src or "attention_interface" in src


def _origin(cls: type, attr: str = "forward") -> type | None:
    for base in cls.__mro__:
        if attr in base.__dict__:
            return base
    return None


def _is_known(cls: type) -> bool:
    return cls.__module__.startswith(_KNOWN_PREFIXES) or cls.__module__ == "torch"


def _patched_classes() -> frozenset[str]:
    """The class names the registry's kinds patch by exact name."""
    return frozenset(c for layer in registered() for c in layer.classes)


def _conv_reason(mod: torch.nn.Module) -> str | None:
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


def _mixer_reason(mod: torch.nn.Module) -> str | None:
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
    convs = [c for c in mod.children() if _conv_reason(c)]
    if convs:
        return f"recurrent / convolutional mixer: {_conv_reason(convs[0])}"
    if (
        _MIXER_NAME.search(cls.__name__)
        and "Norm" not in cls.__name__
        and not _dispatches_attention(cls)
        and not _holds_handled_mixer(mod)
    ):
        return f"class name names a token mixer ({_MIXER_NAME.search(cls.__name__).group(0)}) with no tree-exact path"
    return None


def _attention_refusals(mod: torch.nn.Module, config: Any) -> list[str]:
    out = []
    if getattr(mod, "is_causal", True) is False:
        out.append("bidirectional attention (is_causal=False): tree attention is causal")
    drop = getattr(mod, "attention_dropout", 0.0)
    if mod.training and isinstance(drop, (int, float)) and drop > 0:
        out.append(f"attention dropout {drop} while training; set attention_dropout=0 or call model.eval()")
    return out


def _config_refusals(
    config: Any, *, output: str, hidden_transforms: bool, kwargs: dict, row_len: int | None = None
) -> list[Refusal]:
    """Model-wide settings with no tree-exact path (RoPE scaling, chunked attention, ALiBi, aux losses, logit transforms)."""
    out: list[Refusal] = []
    name = type(config).__name__
    for rope in _rope_dicts(config):
        kind = str(rope.get("rope_type", rope.get("type", "default")))
        if kind in _LENGTH_DEPENDENT_ROPE or "dynamic" in kind:
            out.append(
                Refusal(
                    "config.rope_parameters",
                    name,
                    f"length-dependent RoPE {kind!r}: HF scales it by the longest position of the whole packed call, so sequences would change each other's rotary embedding",
                )
            )
    floor_scale = getattr(config, "floor_scale", None)
    if (
        getattr(config, "attn_temperature_tuning", False)
        and floor_scale
        and row_len is not None
        and row_len >= floor_scale
    ):
        # Llama4 scales NoPE queries by log1p(floor((i + 1) / floor_scale)) of the ROW index i, not
        # of position_ids: every index below floor_scale - 1 gets scale 1 whatever the sequence, so
        # rows shorter than floor_scale are exact; longer rows would scale by the wrong position.
        out.append(
            Refusal(
                "config.attn_temperature_tuning",
                name,
                f"NoPE attention temperature tuning reads the row index, not the position: exact only for rows shorter than floor_scale={floor_scale}, got rows of {row_len}; use seq_len < {floor_scale}",
            )
        )
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type", None) == "alibi":
        out.append(Refusal("config.alibi", name, "ALiBi biases are not applied by tree attention"))
    if kwargs.get("output_router_logits", getattr(config, "output_router_logits", False)):
        out.append(
            Refusal(
                "output_router_logits",
                name,
                "MoE auxiliary (load-balancing) loss: HF averages it over the packed positions, where a shared prefix counts once for all its sharers, so it differs from the unpacked batch's; pass output_router_logits=False",
            )
        )
    if output == "hidden" and not hidden_transforms:
        for attr in _LOGIT_TRANSFORMS:
            v = getattr(config, attr, None)
            if v not in (None, 0, 0.0, 1, 1.0):
                out.append(
                    Refusal(
                        f"config.{attr}",
                        name,
                        f"output='hidden' returns states before the model's logit transform {attr}={v}; use output='logits'",
                    )
                )
    return out


def _rope_dicts(config: Any) -> list[dict]:
    out = []
    for attr in ("rope_parameters", "rope_scaling"):
        v = getattr(config, attr, None)
        if not isinstance(v, dict) or not v:
            continue
        per_layer_type = all(isinstance(x, dict) for x in v.values())
        out.extend(v.values()) if per_layer_type else out.append(v)
    return out


def _configs(model: Any) -> list[Any]:
    """The model's config and its nested text/decoder configs."""
    config = getattr(model, "config", None)
    out = [config] if config is not None else []
    for attr in ("text_config", "decoder", "language_config", "llm_config"):
        sub = getattr(config, attr, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out.append(sub)
    return out


def _classify(path: str, mod: torch.nn.Module, config: Any, report: SupportReport, patch_layers: bool) -> bool:
    """Record how ``mod`` runs; returns True when its children are covered by it (skip them)."""
    cls = type(mod)
    patches = _patched_classes()
    if cls.__name__ in patches:
        if not patch_layers:
            report.refusals.append(
                Refusal(
                    path,
                    cls.__name__,
                    "its tree patch is off (patch_layers=False): the stock forward scans the whole row",
                )
            )
        else:
            report.handled[path] = f"patch:{cls.__name__}"
        return True
    if is_handled(mod):
        if not patch_layers:
            report.refusals.append(
                Refusal(
                    path,
                    cls.__name__,
                    f"its tree forward ({mixer_kind(mod)}) is off (patch_layers=False): the stock forward scans the whole row",
                )
            )
        else:
            report.handled[path] = f"mixer:{mixer_kind(mod)}"
        return True
    patched_base = next((b.__name__ for b in cls.__mro__[1:] if b.__name__ in patches), None)
    if patched_base is not None:
        report.refusals.append(
            Refusal(
                path,
                cls.__name__,
                f"subclass of {patched_base}, whose tree patch matches that exact class only (its forward may differ)",
            )
        )
        return True
    origin = _origin(cls)
    if _dispatches_attention(cls):
        if origin is not None and not _is_known(origin):
            report.refusals.append(
                Refusal(path, cls.__name__, f"attention forward overridden in {origin.__module__}.{origin.__name__}")
            )
        for reason in _attention_refusals(mod, config):
            report.refusals.append(Refusal(path, cls.__name__, reason))
        report.handled[path] = "tree_attention"
        return False
    reason = _mixer_reason(mod) or _conv_reason(mod)
    if (
        reason is None
        and _ATTENTION_NAME.search(cls.__name__)
        and any(True for _ in mod.parameters())
        and not _has_dispatching_child(mod)
    ):
        reason = "attention that does not dispatch through HF's AttentionInterface (its own mask and softmax run over the whole row)"
    if reason is None and origin is not None and not _is_known(origin):
        reason = f"forward defined outside torch / transformers ({origin.__module__}.{origin.__qualname__}): treepack cannot tell whether it mixes tokens"
    if reason is not None:
        report.refusals.append(Refusal(path, cls.__name__, reason))
        return True
    return False


def _holds_handled_mixer(mod: torch.nn.Module) -> bool:
    """A container (e.g. ``JambaMambaDecoderLayer``) whose name matches a mixer but whose mixer is
    a handled descendant: the name says nothing about the container itself, and the walk still
    judges every other child."""
    patches = _patched_classes()
    return any(type(m).__name__ in patches or is_handled(m) for m in mod.modules() if m is not mod)


def _has_dispatching_child(mod: torch.nn.Module) -> bool:
    return any(_dispatches_attention(type(m)) for m in mod.modules() if m is not mod)


def _position_refusals(model: Any) -> list[Refusal]:
    """A model (or base model) whose forward takes no ``position_ids`` numbers the row's tokens 0..L-1 itself."""
    out = []
    if not _reads_positions(model):
        return out
    for path, mod in (("", model), ("base_model", getattr(model, "base_model", None))):
        if isinstance(mod, torch.nn.Module) and "position_ids" not in inspect.signature(mod.forward).parameters:
            out.append(
                Refusal(
                    path,
                    type(mod).__name__,
                    "its forward takes no position_ids: positions would run over the whole row, not restart per sequence",
                )
            )
            break
    return out


def _conv_width_refusals(model: Any, report: SupportReport, conv_width: int) -> list[Refusal]:
    """Handled layers whose causal conv is wider than the plan's ``conv_width`` (their tree conv
    would need more context than the plan's conv metadata holds)."""
    out = []
    for path, how in report.handled.items():
        if how == "tree_attention":
            continue
        mod = model.get_submodule(path)
        layer = handled_layer(mod)
        reason = (
            None if layer is None or layer.conv_width is None else conv_width_refusal(layer.conv_width(mod), conv_width)
        )
        if reason is not None:
            out.append(Refusal(path, type(mod).__name__, reason))
    return out


def _reads_positions(model: Any) -> bool:
    """Whether anything in ``model`` depends on token positions: attention (causal masks, RoPE)
    or a positional embedding. A pure state-space model (Mamba2) reads none, so a forward
    without ``position_ids`` loses nothing there; its mixers follow the tree from the plan."""
    for name, mod in model.named_modules():
        cls = type(mod)
        if (
            _dispatches_attention(cls)
            or _ATTENTION_NAME.search(cls.__name__)
            or _POSITION_NAME.search(name)
            or _POSITION_NAME.search(cls.__name__)
        ):
            return True
    return False


def _backend_refusals(model: Any, backend: str) -> list[Refusal]:
    """``flex`` hands the model a ``BlockMask``; a model that inspects its mask as a tensor cannot take one."""
    if backend != "flex":
        return []
    for mod in (model, getattr(model, "base_model", None)):
        try:
            src = inspect.getsource(type(mod).forward)
        except (OSError, TypeError):
            continue
        if re.search(r"\battention_mask\.(ndim|dim\(\))", src):
            return [
                Refusal(
                    "",
                    type(mod).__name__,
                    "its forward reads the attention mask as a tensor (ndim); the flex BlockMask is not one: use backend='sdpa' or 'flash'",
                )
            ]
    return []


def _layer_type_refusals(model: torch.nn.Module, config: Any, report: SupportReport) -> None:
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or not types:
        return
    layers = next(
        (
            m
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.ModuleList) and len(m) == len(types) and n.endswith("layers")
        ),
        None,
    )
    prefix = next((n for n, m in model.named_modules() if m is layers), "")
    for i, kind in enumerate(types):
        if kind in ATTENTION_LAYER_TYPES or kind in PER_TOKEN_LAYER_TYPES:
            continue
        root = f"{prefix}.{i}"
        covered = layers is not None and any(
            p == root or p.startswith(root + ".") for p, how in report.handled.items() if how != "tree_attention"
        )
        refused = any(r.path == root or r.path.startswith(root + ".") for r in report.refusals)
        if not covered and not refused:
            report.refusals.append(
                Refusal(
                    root if layers is not None else "config.layer_types",
                    str(kind),
                    f"layer type {kind!r} (config.layer_types[{i}]) has no tree-exact mixer",
                )
            )


def check_model(
    model: Any,
    *,
    backend: str = "sdpa",
    output: str = "logits",
    patch_layers: bool = True,
    hidden_applies_logit_transforms: bool = False,
    raise_error: bool = True,
    row_len: int | None = None,
    conv_width: int | None = None,
    allow_dropout: bool = False,
    **kwargs: Any,
) -> SupportReport:
    """Check that every token mixer of ``model`` runs tree-exact; refuse before any compute otherwise.

    Args:
        model: an HF causal LM (or its base model).
        backend: ``sdpa`` | ``flex`` | ``flash`` (all run the same layer set).
        output: ``logits`` or ``hidden`` (see :func:`~treepack.trainer.hf.packed_forward`).
        patch_layers: whether the layer patches (:func:`~treepack.trainer.hf.layers.patch_layers`)
            will be installed.
        hidden_applies_logit_transforms: the caller's ``output="hidden"`` path applies the
            model's final logit transforms (then they are not refused).
        raise_error: raise on refusals (default); False returns the report to inspect.
        row_len: the packed rows' length (``batch.seq_len``), for settings that read the
            row index instead of ``position_ids`` (Llama4's NoPE temperature tuning).
        conv_width: the plan's ``conv_width``: a handled mixer whose causal conv is wider
            needs more ancestor context than the plan carries, so it is refused here, before
            any layer runs.
        allow_dropout: accept dropout outside attention while training (one mask per shared
            prefix, not exact); by default it is refused (:mod:`treepack.trainer.hf.guards`).
        **kwargs: the keyword arguments the model will be called with
            (``output_router_logits`` is checked).

    Returns:
        The :class:`SupportReport` (``handled`` paths and, with ``raise_error=False``, refusals).

    Raises:
        UnsupportedModelError: naming each refused module's path, class and reason.
    """
    report = SupportReport()
    for config in _configs(model):
        report.refusals.extend(
            _config_refusals(
                config, output=output, hidden_transforms=hidden_applies_logit_transforms, kwargs=kwargs, row_len=row_len
            )
        )
    report.refusals.extend(_position_refusals(model))
    report.refusals.extend(_backend_refusals(model, backend))
    config = getattr(model, "config", None)
    towers = vision_towers(model)
    report.handled.update(towers)
    report.refusals.extend(Refusal(*r) for r in vision_refusals(model))
    skip: tuple[str, ...] = tuple(towers)
    for path, mod in model.named_modules():
        if skip and any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if _classify(path, mod, config, report, patch_layers):
            skip += (path,)
    for cfg in _configs(model):
        _layer_type_refusals(model, cfg, report)
    if conv_width is not None:
        report.refusals.extend(_conv_width_refusals(model, report, conv_width))
    # A hook inside a vision tower sees one image, as the tower runs outside the rows.
    hooks = [r for r in patch_refusals(model) if not any(r[0] == t or r[0].startswith(t + ".") for t in towers)]
    report.refusals.extend(Refusal(*r) for r in dropout_refusals(model, allow_dropout=allow_dropout) + hooks)
    if report.refusals and raise_error:
        shown = "; ".join(str(r) for r in report.refusals[:6])
        more = f" (+{len(report.refusals) - 6} more)" if len(report.refusals) > 6 else ""
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot run tree-packed exactly: {shown}{more}",
            path=f"$.model.{report.refusals[0].path}" if report.refusals[0].path else "$.model",
            rule="unsupported_model",
            refusals=tuple((r.path, r.cls, r.reason) for r in report.refusals),
        )
    return report
