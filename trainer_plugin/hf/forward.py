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

:func:`packed_forward` is a short pipeline: the options become one
:class:`~treepack.trainer.hf.admission.PackedSetup`, the model is admitted
(:func:`~treepack.trainer.hf.admission.admit`: the checks, the hooks and patches, the probe),
and the batch's metadata is built and the model run (:mod:`treepack.trainer.hf.run`).

Nothing about the model is left switched: after ``packed_forward`` returns, unpacked calls
(``generate()``, reference passes) run exactly as before, with the model's own
``attn_implementation``; gradient checkpointing still replays the packed layers in
``backward()`` because the dispatch follows the replayed arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from treepack.proto.errors import RequestError
from treepack.trainer.data.packed_batch import PackedBatch
from treepack.trainer.hf.admission import PackedSetup, admit
from treepack.trainer.hf.context import BATCH_KWARG, PackedContext, use_packed
from treepack.trainer.hf.run import run_packed
from treepack.trainer.hf.wrapped import unwrap_model

__all__ = ["packed_forward", "packed", "RESERVED_KWARGS"]

_ROWS = "packed_forward passes the packed rows' own"
#: Model-call keywords ``packed_forward`` sets itself or that have no meaning on tree rows:
#: name -> why, and what to do instead. Passed in ``**kwargs`` they are refused by name
#: before any compute (else Python's ``dict() got multiple values``, or a silently wrong call).
RESERVED_KWARGS: dict[str, str] = {
    "input_ids": f"{_ROWS} tokens (batch.input_ids); put the tokens in the batch (materialize)",
    "position_ids": f"{_ROWS} positions, each token's position in its own sequence (batch.position_ids)",
    "attention_mask": f"{_ROWS} tree mask (the mask contract of the plan); there is no padding mask to pass",
    "inputs_embeds": f"{_ROWS} tokens as input_ids; embeddings computed elsewhere have no tree-row form",
    "use_cache": "a packed forward keeps no KV cache (packed_forward passes use_cache=False); generate unpacked",
    "past_key_values": "a packed forward starts from no cache: every row runs whole; generate unpacked",
    "cache_position": "a packed forward keeps no cache; positions come from the batch (batch.position_ids)",
    "labels": (
        "HF's loss shifts labels along the row, but after a branch a token's next token is in a child segment, "
        "not at the next row index; score the logits with batch.target_logprobs and treepack's losses"
    ),
    "logits_to_keep": (
        "the last row positions are no sequence's last tokens; use output='hidden' with "
        "batch.target_logprobs_from_hidden to skip the [K, L, vocab] logits"
    ),
    BATCH_KWARG: "packed_forward sets the packed batch itself: pass the batch as packed_forward's batch",
    "alora_offsets": (
        "PEFT's aLoRA offsets count from a row's end, one per row; packed_forward computes each sequence's "
        "activation from the batch (treepack.trainer.hf.alora)"
    ),
    "adapter_names": "PEFT picks one adapter per input row, and a packed row holds several sequences; run unpacked",
}


def refuse_reserved_kwargs(kwargs: dict[str, Any]) -> None:
    """Refuse model-call keywords that ``packed_forward`` sets itself or that tree rows give no meaning.

    Args:
        kwargs: the keywords meant for ``model(...)``.

    Raises:
        RequestError: naming the first reserved keyword (:data:`RESERVED_KWARGS`), why, and what
            to do instead.
    """
    for name, why in RESERVED_KWARGS.items():
        if name in kwargs:
            raise RequestError(
                f"{name}= passed to packed_forward: {why}", path=f"$.kwargs.{name}", rule="reserved_kwarg"
            )


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
    allow_stochastic: bool = False,
    **kwargs: Any,
) -> torch.Tensor:
    """Run an HF causal LM on the packed rows, leaving the model as it was.

    The first call for a setup (model, its wrappers, backend, train/eval, gradient
    checkpointing, dtype, device, autocast) first proves packing exact on a small probe batch
    against every sequence alone, forward and gradients, through ``model`` under the caller's
    autocast: within a small stated multiple of the model's own drift between unpacked batch
    shapes at the precision it computes in (:mod:`treepack.trainer.hf.admission.probe`); later
    calls of that setup skip it.
    The model walk (the support check, the guards, the dispatch hooks and layer patches) runs
    once per model state: a later call on a model changed in anything the guards read (a
    hook, a patch, a module, the mode, dropout, the config) walks and judges it again
    (:mod:`treepack.trainer.hf.admission.walk_cache`). Every plan-derived structure the layers read
    (mask, varlen metadata, tree schedule) is built once per batch, before the first layer.

    Args:
        model: an HF ``*ForCausalLM`` (or any model returning ``.logits``), a
            ``*ForTokenClassification`` (value head) or a ``*ForSequenceClassification``
            (reward model; :mod:`treepack.trainer.hf.task_head`) whose layers dispatch
            attention through ``AttentionInterface``; bare or wrapped (DDP, FSDP2, PEFT,
            accelerate, ``torch.compile``): the forward runs through the wrapper.
        batch: the packed batch; one rank's CP shard (``materialize(..., cp=...)``) runs
            with the CP collectives inside (attention: Ulysses) and gives this shard's
            logits [K, shard_len, vocab].
        backend: ``sdpa`` | ``flex`` | ``flash`` (:func:`~treepack.trainer.tree_attention`).
        varlen_fn: ``flash`` backend kernel override (e.g. ``naive_varlen_attention`` on CPU).
        compile: ``flex`` backend: compile ``flex_attention`` (default: on CUDA).
        output: ``logits``, or ``hidden`` for the base model's final hidden states (the head
            runs on no position); then :meth:`PackedBatch.target_logprobs_from_hidden` with
            :func:`~treepack.trainer.hf.head.output_head` never materializes [K, L, vocab].
        patch_layers: patch the registry's layers for tree rows (see
            :func:`~treepack.trainer.hf.admission.enable_tree_attention`); False only to run their
            stock forward on purpose (a negative control).
        verify: run the probe on the first call of a setup (default). False skips it, for a
            setup already proven in an earlier run.
        allow_dropout: accept dropout outside attention while training, knowing that every
            sharer of a packed prefix then gets one dropout mask (not exact; default False:
            refused, :mod:`treepack.trainer.hf.admission.guards`).
        allow_stochastic: accept other random draws while training (router jitter, sampling
            routers, layerdrop, stochastic depth), knowing that every sharer of a packed prefix
            then gets one draw (not exact; default False: refused by name).
        **kwargs: passed to ``model(...)``; what ``packed_forward`` sets itself (the rows'
            ``input_ids``, ``position_ids``, tree ``attention_mask``, ``use_cache=False``) and
            what tree rows give no meaning (``labels``, ``logits_to_keep``, a cache) are
            refused (:data:`RESERVED_KWARGS`).

    Returns:
        [K, L, vocab] logits, or [K, L, hidden] hidden states, of the packed rows; a token
        head's [K, L, num_labels] values (:meth:`PackedBatch.unpack_values`); a sequence
        head's [S_local, num_labels] scores, one per sequence of ``batch.local_seqs``, each
        read at the sequence's own last non-pad token.

    Raises:
        UnsupportedModelError: the admission refuses the model (:func:`~treepack.trainer.hf.admission.admit`:
            the static check, the CP check, or the probe finds packed and alone differ, naming
            the first diverging module).
        RequestError: ``backend`` or ``output`` is not a known value.
    """
    refuse_reserved_kwargs(kwargs)
    hf = unwrap_model(model)
    options = {"backend": backend, "output": output, "varlen_fn": varlen_fn, "compile": compile}
    accepted = {"allow_dropout": allow_dropout, "allow_stochastic": allow_stochastic}
    setup = PackedSetup.of_call(batch, kwargs, patch_layers=patch_layers, verify=verify, **accepted, **options)
    verdict = admit(model, setup)  # as held: PEFT's adapters are judged on its wrapper
    return run_packed(model, hf, batch, setup, scans=verdict.scans, kwargs=kwargs)


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
    keys = ("backend", "output", "varlen_fn", "compile")
    setup = PackedSetup(**{k: options[k] for k in keys if k in options})
    outer = PackedContext(
        batch=batch, backend=setup.backend, options={"varlen_fn": setup.varlen_fn, "compile": setup.compile}
    )

    def run(**kw: Any) -> torch.Tensor:
        return packed_forward(model, batch, **{**options, **kw})

    with use_packed(outer):
        yield run
