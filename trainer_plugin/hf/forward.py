"""HF transformers on tree-packed rows: :func:`packed_forward` and :func:`packed`.

:func:`packed_forward` runs a stock HF decoder model (Qwen3, Llama, Mistral, ...), possibly
wrapped (DDP, FSDP2, PEFT/LoRA, accelerate; :mod:`treepack.trainer.hf.wrapped`), on a
:class:`~treepack.trainer.data.packed_batch.PackedBatch`:

- ``input_ids`` and the per-sequence ``position_ids`` go in as they are, so RoPE sees
  each token's position in its own sequence;
- a batch with images (``materialize(..., pixel_values=...)``) runs the vision tower once
  per distinct image and hands the features and, for mRoPE models, each sequence's own 3-D
  positions to the model (:mod:`treepack.trainer.hf.vision`);
- the batch travels as the keyword argument ``treepack_context`` (HF forwards ``**kwargs``
  to every decoder layer and attention function, and activation checkpointing replays it)
  and in a context variable (:mod:`treepack.trainer.hf.context`) for layers without
  ``**kwargs``;
- every module that holds a config switches to the registered ``"treepack"`` attention
  (:data:`~treepack.trainer.hf.attention.ATTN_IMPLEMENTATION`) for the calls that carry that
  keyword only (:mod:`treepack.trainer.hf.dispatch`). HF builds no mask for an implementation
  without a mask function, so it never infers the (linear, wrong) packing from
  ``position_ids``; ``packed_forward`` passes the tree mask itself (dense for ``sdpa``,
  BlockMask for ``flex``). Other layer kinds (recurrent and conv mixers, sparse indexers) are patched
  to read the same context and run their stock forward without it.

Nothing about the model is left switched: after ``packed_forward`` returns, unpacked calls
(``generate()``, reference passes) run exactly as before, with the model's own
``attn_implementation``; gradient checkpointing still replays the packed layers in
``backward()`` because the dispatch follows the replayed arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.profiler import record_function

from treepack.proto.errors import RequestError, UnsupportedModelError
from treepack.trainer.data.materialize import materialize
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.attention import TREE_MASK_OPTION
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.hf.dispatch import install_dispatch
from treepack.trainer.hf.layer_masks import attention_mask_for
from treepack.trainer.hf.layers import handled_layer
from treepack.trainer.hf.layers import patch_layers as patch_layers_of
from treepack.trainer.hf.layers.spec import NOT_SHARDED
from treepack.trainer.hf.probe import ProbeReport, dropout_off, verify_packing
from treepack.trainer.hf.support import check_model
from treepack.trainer.hf.vision import image_inputs
from treepack.trainer.hf.walk_cache import fingerprint, remember_walk, walk_info, walked
from treepack.trainer.hf.wrapped import forward_hidden, forward_logits, unwrap_model
from treepack.trainer.kernels.attention import BACKENDS
from treepack.trainer.kernels.cp_attention import shard_mask

__all__ = ["enable_tree_attention", "packed_forward", "packed", "verify_model", "check_cp_layers", "OUTPUTS"]

OUTPUTS = ("logits", "hidden")


def enable_tree_attention(model: Any, *, patch_layers: bool = True) -> str:
    """Prepare ``model`` for packed calls (idempotent); returns its attention implementation.

    Installs the per-call dispatch hooks (:func:`~treepack.trainer.hf.dispatch.install_dispatch`)
    and, with ``patch_layers``, the tree forwards of every layer kind of the registry (GDN,
    Mamba2, Mamba, KDA, short conv, DeepSeek-V3.2 sparse attention:
    :func:`treepack.trainer.hf.layers.patch_layers`). Neither changes an unpacked call; the
    model's ``attn_implementation`` stays what it was, so nothing needs switching back.

    Args:
        model: the HF model, possibly wrapped.
        patch_layers: also patch the registry's layers (without the patches those layers
            would scan each row as one sequence).

    Returns:
        The model's (unchanged) ``config._attn_implementation``.
    """
    hf = unwrap_model(model)
    install_dispatch(hf)
    if patch_layers:
        patch_layers_of(hf)
    return hf.config._attn_implementation


def _check_args(backend: str, output: str) -> None:
    if backend not in BACKENDS:
        raise RequestError(f"backend must be one of {BACKENDS}, got {backend!r}", path="$.backend", rule="enum")
    if output not in OUTPUTS:
        raise RequestError(f"output must be one of {OUTPUTS}, got {output!r}", path="$.output", rule="enum")


def check_cp_layers(model: torch.nn.Module, cp_size: int, contiguous: bool = True) -> None:
    """Refuse, before compute, every layer of ``model`` that has no context-parallel path.

    Attention runs Ulysses (:mod:`treepack.trainer.hf.attention`); a kind of the layer
    registry runs under CP only when its ``shard`` slot says how, and only when that slot
    does not refuse the module over ``cp_size`` ranks (e.g. heads that do not divide).
    The mixers' layout puts the ranks' shards end to end as whole rows, so with a split
    that is not contiguous (``contiguous=False``: the all-gather plan's tiles) every kind of
    the registry is refused.

    Raises:
        UnsupportedModelError: naming each refused module's path, class and why.
    """
    refusals = []
    for name, mod in model.named_modules():
        layer = handled_layer(mod)
        if layer is None:
            continue
        if not contiguous:
            why = f"layer kind {layer.kind!r} runs under CP on contiguous shards only; this plan's split is balanced for all-gather (plan with cp_attention 'auto' or 'ulysses')"
        elif layer.shard is NOT_SHARDED:
            why = (
                f"layer kind {layer.kind!r} has no context-parallel path (its tree scan runs on whole rows of one rank)"
            )
        else:
            why = layer.shard.refuse(mod, cp_size)
        if why is not None:
            refusals.append((name, type(mod).__name__, why))
    if refusals:
        lines = "; ".join(f"{n} ({c}): {w}" for n, c, w in refusals)
        raise UnsupportedModelError(
            f"context parallelism over {cp_size} ranks refused: {lines}",
            rule="cp_unsupported_layer",
            refusals=tuple(refusals),
        )


def _kwargs_key(kwargs: dict) -> tuple:
    """The model-call keyword arguments as a walk's setup key (values that are not plain: by type)."""
    return tuple(
        sorted(
            (k, v if v is None or isinstance(v, (bool, int, float, str)) else type(v).__name__)
            for k, v in kwargs.items()
        )
    )


def _numerics(hf: torch.nn.Module) -> tuple:
    """What a probe depends on beyond the model's modules: dtype and device of its
    parameters, gradient mode, autocast (:func:`~treepack.trainer.hf.probe.probe_signature`)."""
    p = next(hf.parameters(), None)
    dev = p.device.type if p is not None else "cpu"
    autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else None
    return (
        str(p.dtype) if p is not None else "",
        str(p.device) if p is not None else "",
        torch.is_grad_enabled(),
        autocast,
    )


def _mask(batch: PackedBatch, backend: str, scans: bool = False) -> Any:
    """The attention mask handed to the model; builds, before the first layer runs, every
    plan-derived structure the layers read (varlen metadata, with ``scans`` the tree schedule
    of the recurrent / conv layers), once per batch and on the batch's device."""
    if batch.cp is not None:
        if batch.cp_strategy == "allgather":
            return shard_mask(batch, backend)  # this shard's queries over the whole key axis
        batch = batch.cp_full  # Ulysses attention runs whole rows
    elif scans:
        batch.tree_schedule()
    if backend == "sdpa":
        return batch.dense_mask()
    if backend == "flex":
        return batch.block_mask()
    # No mask for varlen kernels; their metadata is built (and on the device) now, before
    # the first layer runs, not inside layer 0's attention mid-forward.
    batch.varlen_meta()
    return None


def packed_forward(
    model: Any,
    batch: PackedBatch,
    *,
    backend: str = "sdpa",
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    output: str = "logits",
    patch_layers: bool = True,
    verify: bool = True,
    allow_dropout: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """Run an HF causal LM on the packed rows, leaving the model as it was.

    The first call for a setup (model, backend, train/eval, gradient checkpointing, dtype,
    device) first proves packing exact on a small probe batch against every sequence alone,
    forward and gradients (:mod:`treepack.trainer.hf.probe`); later calls of that setup skip it.
    The model walk (the support check, the guards, the dispatch hooks and layer patches) runs
    once per model state: a later call on a model changed in anything the guards read (a
    hook, a patch, a module, the mode, dropout, the config) walks and judges it again
    (:mod:`treepack.trainer.hf.walk_cache`). Every plan-derived structure the layers read
    (mask, varlen metadata, tree schedule) is built once per batch, before the first layer.

    Args:
        model: an HF ``*ForCausalLM`` (or any model returning ``.logits``) whose layers
            dispatch attention through ``AttentionInterface``; bare or wrapped (DDP, FSDP2,
            PEFT, accelerate, ``torch.compile``): the forward runs through the wrapper.
        batch: the packed batch; one rank's CP shard (``materialize(..., cp=...)``) runs
            with the CP collectives inside (attention: Ulysses) and gives this shard's
            logits [K, shard_len, vocab].
        backend: ``sdpa`` | ``flex`` | ``flash`` (:func:`~treepack.trainer.tree_attention`).
        varlen_fn: ``flash`` backend kernel override (e.g. ``naive_varlen_attention`` on CPU).
        compile: ``flex`` backend: compile ``flex_attention`` (default: on CUDA).
        output: ``logits``, or ``hidden`` for the base model's final hidden states (the head
            runs on no position); then :meth:`PackedBatch.target_logprobs_from_hidden` with
            :func:`~treepack.trainer.hf.head.output_head` never materializes [K, L, vocab].
        patch_layers: patch the registry's layers for tree rows (see :func:`enable_tree_attention`);
            False only to run their stock forward on purpose (a negative control).
        verify: run the probe on the first call of a setup (default). False skips it, for a
            setup already proven in an earlier run.
        allow_dropout: accept dropout outside attention while training, knowing that every
            sharer of a packed prefix then gets one dropout mask (not exact; default False:
            refused, :mod:`treepack.trainer.hf.guards`).
        **kwargs: passed to ``model(...)``.

    Returns:
        [K, L, vocab] logits, or [K, L, hidden] hidden states, of the packed rows.

    Raises:
        UnsupportedModelError: :func:`~treepack.trainer.hf.support.check_model` refuses the
            model, or the probe finds packed and alone differ (naming the first diverging module).
    """
    _check_args(backend, output)
    hf = unwrap_model(model)
    conv_width = batch.plan.gdn.conv_width
    with record_function("treepack::walk"):
        # The walk once per model state and setup (treepack.trainer.hf.walk_cache): a model
        # changed since (hooks, patches, modules, modes, config) is walked, and judged, again.
        state = fingerprint(hf)
        setup = (
            "check",
            backend,
            output,
            bool(patch_layers),
            batch.plan.seq_len,
            conv_width,
            bool(allow_dropout),
            (batch.cp.size, batch.plan.ranks.contiguous) if batch.cp is not None else 0,
            _kwargs_key(kwargs),
        )
        if not walked(hf, setup, state):
            check_model(
                hf,
                backend=backend,
                output=output,
                patch_layers=patch_layers,
                hidden_applies_logit_transforms=True,
                row_len=batch.plan.seq_len,
                conv_width=conv_width,
                allow_dropout=allow_dropout,
                **kwargs,
            )
            if batch.cp is not None:
                check_cp_layers(hf, batch.cp.size, batch.plan.ranks.contiguous)
            enable_tree_attention(hf, patch_layers=patch_layers)
            # Whether layers of the registry read the rows' tree schedule (built before the forward).
            remember_walk(
                hf, setup, info=bool(patch_layers) and any(handled_layer(m) is not None for m in hf.modules())
            )
            state = None
        probed = ("probe", backend, bool(patch_layers), conv_width, bool(allow_dropout), *_numerics(hf))
        if verify and not walked(hf, probed, state):
            verify_model(
                hf,
                backend=backend,
                patch_layers=patch_layers,
                conv_width=conv_width,
                varlen_fn=varlen_fn,
                compile=compile,
                allow_dropout=allow_dropout,
            )
            # The probe's own recording hooks, registered and removed, moved torch's hook
            # count: the model is the one just walked.
            remember_walk(hf, setup, info=walk_info(hf, setup))
            remember_walk(hf, probed)
    mm = image_inputs(hf, batch, kwargs)
    with record_function("treepack::metadata"):
        mask = _mask(batch, backend, scans=bool(walk_info(hf, setup)))
    ctx = PackedContext(
        batch=batch, backend=backend, options={"varlen_fn": varlen_fn, "compile": compile, TREE_MASK_OPTION: mask}
    )
    inputs = dict(
        input_ids=batch.input_ids,
        position_ids=mm.pop("position_ids", batch.position_ids),
        attention_mask=attention_mask_for(hf, mask),
        use_cache=False,
        **{BATCH_KWARG: ctx},
        **mm,
        **kwargs,
    )
    with use_packed(ctx):
        if output == "hidden":
            return forward_hidden(model, hf, inputs)
        return forward_logits(model, inputs)


def verify_model(
    hf: Any,
    *,
    backend: str = "sdpa",
    patch_layers: bool = True,
    conv_width: int = 4,
    varlen_fn: Callable | None = None,
    compile: bool | None = None,
    allow_dropout: bool = False,
) -> ProbeReport:
    """Prove packing exact for ``hf`` as it is now (the probe, once per setup; :mod:`treepack.trainer.hf.probe`).

    Args:
        hf: the unwrapped HF causal LM, in the mode it will train in.
        backend, patch_layers, varlen_fn, compile: as for :func:`packed_forward`.
        conv_width: the plan's GDN conv width (the probe plans with it).
        allow_dropout: the caller accepted dropout (:func:`packed_forward`): the probe runs
            with every dropout rate at 0, since no shared mask can equal the alone runs.

    Returns:
        The :class:`~treepack.trainer.hf.probe.ProbeReport` of the setup.

    Raises:
        UnsupportedModelError: packed and alone differ beyond the measured bound.
    """

    def plan_and_batch(seqs: list) -> tuple[Any, PackedBatch]:
        from treepack.client import Packer

        step = 128 if backend == "flex" else 16
        seq_len = -(-sum(len(s) for s in seqs) // step) * step
        with Packer() as packer:
            plan = packer.pack(
                seqs,
                seq_len=seq_len,
                trainable=[1] * len(seqs),
                min_shared_len=2,
                share_trainable=True,
                conv_width=conv_width,
                record=False,
            )
        device = next(hf.parameters()).device
        return plan, materialize(plan, seqs, device=device, trainable=[1] * len(seqs), advise=False)

    def run_packed(b: PackedBatch) -> torch.Tensor:
        return packed_forward(
            hf, b, backend=backend, varlen_fn=varlen_fn, compile=compile, patch_layers=patch_layers, verify=False
        )

    # Outside any packed context of the caller: the probe's unpacked runs must be plain ones.
    with use_packed(None), dropout_off(hf) if allow_dropout else nullcontext():
        return verify_packing(
            hf,
            backend=backend,
            patch_layers=patch_layers,
            run_packed=run_packed,
            plan_and_batch=plan_and_batch,
            extra=("allow_dropout",) if allow_dropout else (),
        )


@contextmanager
def packed(model: Any, batch: PackedBatch, **options: Any) -> Iterator[Callable[..., torch.Tensor]]:
    """Context-manager form: ``with packed(model, batch, backend="flash") as run: logits = run()``.

    ``run(**kw)`` is :func:`packed_forward` with ``options`` and ``kw`` merged (``kw`` wins).
    Inside the block the batch is also the current packed context, so a ``backward()`` run
    inside the block can recompute layers that read only the context variable. Leaving the
    block leaves the model as it was.

    Args:
        model: as for :func:`packed_forward`.
        batch: the packed batch.
        **options: :func:`packed_forward` keyword arguments (backend, output, ...).

    Yields:
        ``run``, a callable returning what :func:`packed_forward` returns.
    """
    _check_args(options.get("backend", "sdpa"), options.get("output", "logits"))
    outer = PackedContext(
        batch=batch,
        backend=options.get("backend", "sdpa"),
        options={"varlen_fn": options.get("varlen_fn"), "compile": options.get("compile")},
    )

    def run(**kw: Any) -> torch.Tensor:
        return packed_forward(model, batch, **{**options, **kw})

    with use_packed(outer):
        yield run
