"""Fail-closed support check: every token mixer of a model is tree-exact, or the call is refused.

:func:`check_static` (and its keyword form :func:`check_model`) walks every submodule of an
HF model before :func:`~treepack.trainer.hf.packed_forward` computes anything. A module that mixes tokens
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
- length-dependent RoPE (``dynamic`` NTK, ``longrope``, judged by the type each rotary
  module resolved, so HunYuan's fixed-``alpha`` "dynamic" passes): HF picks the scaling
  from the longest position of the whole call, so one long sequence would change the
  others' rotary embedding. Refused (decision, see docs/models.md): exact needs every
  sequence's scaling regime in the plan's keys, and a packed row would still need one
  rotary table per sequence, which HF's rotary module does not take;
- MoE auxiliary losses (``output_router_logits``): HF's load-balancing loss averages over
  the positions of the rows, where a shared prefix is one position for all its sharers, so
  it differs from the unpacked batch's; refused;
- logit post-processing (``final_logit_softcapping``, ``logit_scale``, ``logits_scaling``):
  applied by the model for ``output="logits"``; refused for ``output="hidden"`` unless the
  caller applies them (``hidden_applies_logit_transforms=True``, which ``packed_forward``
  passes: :func:`~treepack.trainer.hf.head.output_head` applies them);
- the head (:func:`~treepack.trainer.hf.task_head.head_refusals`): a causal LM, per-token values
  (``*ForTokenClassification``) or per-sequence scores (``*ForSequenceClassification`` that pools
  at the last non-pad token) with ``output="logits"``; any other head is refused by name.

Vision towers of known VLM classes mix only within one image and run once per distinct
image outside the rows (:mod:`treepack.trainer.hf.vision`); other towers are judged like any
module (their patch convolution and bidirectional attention are refused), and VLMs whose
image tokens attend bidirectionally (Gemma 3) are refused by name.

Dropout and other random draws while training (router jitter, layerdrop, stochastic depth;
anywhere, by module, attribute or config field) and forwards or hooks patched in from unknown
code are refused too (:mod:`treepack.trainer.hf.admission.guards`).

The checks, by concept: module structure (:mod:`~treepack.trainer.hf.admission.structure`),
attention (:mod:`~treepack.trainer.hf.admission.attention_checks`), other token mixers
(:mod:`~treepack.trainer.hf.admission.mixers`), positions
(:mod:`~treepack.trainer.hf.admission.positions`), the config
(:mod:`~treepack.trainer.hf.admission.config_checks`), vision towers
(:mod:`treepack.trainer.hf.vision`) and the guards.

Modules from torch and transformers that work per token (linear layers, norms, embeddings,
MLPs, MoE routers, rotary tables) pass; a module whose ``forward`` is defined elsewhere
(outside torch, transformers, peft, accelerate, treepack) is refused: its code is unknown.
"""

from __future__ import annotations

from typing import Any

from treepack.trainer.hf.admission.attention_checks import backend_refusals
from treepack.trainer.hf.admission.config_checks import config_refusals, model_configs
from treepack.trainer.hf.admission.guards import dropout_refusals, patch_refusals, stochastic_refusals
from treepack.trainer.hf.admission.positions import position_refusals
from treepack.trainer.hf.admission.report import Refusal, SupportReport, refused_error
from treepack.trainer.hf.admission.setup import PackedSetup, kwargs_key
from treepack.trainer.hf.admission.structure import classify, conv_width_refusals, layer_type_refusals
from treepack.trainer.hf.task_head import head_refusals
from treepack.trainer.hf.vision import vision_refusals, vision_towers

__all__ = ["check_model", "check_static", "SupportReport", "Refusal"]


def check_static(
    model: Any, setup: PackedSetup, *, hidden_applies_logit_transforms: bool = False, raise_error: bool = True
) -> SupportReport:
    """Check that every token mixer of ``model`` runs tree-exact under ``setup``; refuse before any compute otherwise.

    Args:
        model: an HF causal LM (or its base model), unwrapped.
        setup: the forward's options (backend, output, patch_layers, allow_dropout, allow_stochastic) and what
            the checks read of the call: ``row_len`` (settings that read the row index, Llama4's
            NoPE temperature tuning), ``conv_width`` (a handled mixer whose causal conv is wider
            is refused; None: not checked) and the call keywords (``output_router_logits``).
        hidden_applies_logit_transforms: the caller's ``output="hidden"`` path applies the
            model's final logit transforms (then they are not refused).
        raise_error: raise on refusals (default); False returns the report to inspect.

    Returns:
        The :class:`SupportReport` (``handled`` paths and, with ``raise_error=False``, refusals).

    Raises:
        UnsupportedModelError: naming each refused module's path, class and reason.
    """
    report = SupportReport()
    report.refusals.extend(Refusal(*r) for r in head_refusals(model, setup.output, setup.kwargs, setup.cp_size))
    for config in model_configs(model):
        report.refusals.extend(
            config_refusals(
                config,
                output=setup.output,
                hidden_transforms=hidden_applies_logit_transforms,
                kwargs=setup.kwargs,
                row_len=setup.row_len,
            )
        )
    report.refusals.extend(position_refusals(model))
    report.refusals.extend(backend_refusals(model, setup.backend))
    config = getattr(model, "config", None)
    towers = vision_towers(model)
    report.handled.update(towers)
    report.refusals.extend(Refusal(*r) for r in vision_refusals(model))
    skip: tuple[str, ...] = tuple(towers)
    for path, mod in model.named_modules():
        if skip and any(path == s or path.startswith(s + ".") for s in skip):
            continue
        if classify(path, mod, config, report, setup.patch_layers):
            skip += (path,)
    for cfg in model_configs(model):
        layer_type_refusals(model, cfg, report)
    if setup.conv_width is not None:
        report.refusals.extend(conv_width_refusals(model, report, setup.conv_width))
    # A hook inside a vision tower sees one image, as the tower runs outside the rows.
    hooks = [r for r in patch_refusals(model) if not any(r[0] == t or r[0].startswith(t + ".") for t in towers)]
    draws = dropout_refusals(model, allow_dropout=setup.allow_dropout) + stochastic_refusals(
        model, allow_stochastic=setup.allow_stochastic
    )
    report.refusals.extend(Refusal(*r) for r in draws + hooks)
    if report.refusals and raise_error:
        raise refused_error(model, report)
    return report


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
    allow_stochastic: bool = False,
    **kwargs: Any,
) -> SupportReport:
    """Check that every token mixer of ``model`` runs tree-exact; refuse before any compute otherwise.

    The keyword form of :func:`check_static`: builds the :class:`PackedSetup` and runs it.

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
            prefix, not exact); by default it is refused (:mod:`treepack.trainer.hf.admission.guards`).
        allow_stochastic: accept other random draws while training (router jitter, layerdrop,
            stochastic depth: one draw per shared prefix, not exact); refused by default.
        **kwargs: the keyword arguments the model will be called with
            (``output_router_logits`` is checked).

    Returns:
        The :class:`SupportReport` (``handled`` paths and, with ``raise_error=False``, refusals).

    Raises:
        UnsupportedModelError: naming each refused module's path, class and reason.
        RequestError: ``backend`` or ``output`` is not a known value.
    """
    setup = PackedSetup(
        backend=backend,
        output=output,
        patch_layers=patch_layers,
        allow_dropout=allow_dropout,
        allow_stochastic=allow_stochastic,
        row_len=row_len,
        conv_width=conv_width,
        call_kwargs=kwargs_key(kwargs),
    )
    return check_static(
        model, setup, hidden_applies_logit_transforms=hidden_applies_logit_transforms, raise_error=raise_error
    )
