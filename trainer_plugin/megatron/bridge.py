"""A Megatron-Core ``GPTModel`` for tree rows, built from an HF checkpoint through Megatron-Bridge.

:func:`from_hf` converts the HF model's config and weights with Megatron-Bridge
(``AutoBridge``), builds the model from the tree layer spec
(:func:`~treepack.trainer.megatron.spec.tree_layer_spec`: the local spec, the tree core
attention, mask type ``arbitrary``), swaps in the tree rotary embedding with the HF model's
own frequencies (:mod:`~treepack.trainer.megatron.rope`), refuses any parameter the
conversion left unloaded (HF MoE checkpoints under transformers 5 with Bridge 0.6.2) and
admits the result
(:func:`~treepack.trainer.megatron.spec.check_megatron_model`), all before any compute.

The caller owns the process groups: ``torch.distributed`` and
``megatron.core.parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp,
pipeline_model_parallel_size=1)`` are set up before the call and torn down after;
``from_hf`` neither creates nor destroys them and may be called more than once per process.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from treepack.proto.errors import RequestError, UnsupportedModelError

__all__ = ["from_hf", "INSTALL_HINT"]

INSTALL_HINT = (
    "treepack.trainer.megatron needs megatron-core (>= 0.17) and megatron-bridge (0.6.2): "
    "pip install megatron-core megatron-bridge (docs/megatron.md, Install)"
)

# Kernel fusions (and MoE's grouped GEMM) that need Transformer Engine, apex or CUDA: off on a
# CPU-only host. RoPE fusion is off everywhere: the fused kernel takes Megatron's own
# [s, 1, 1, d] angles, not per-row ones.
_CUDA_FUSIONS = (
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "gradient_accumulation_fusion",
    "persist_layer_norm",
    "cross_entropy_loss_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
    "moe_grouped_gemm",  # GroupedMLP needs Transformer Engine or the grouped_gemm kernels
)


def _require() -> Any:
    """Import Megatron-Bridge's ``AutoBridge`` (and Megatron-Core), or say what to install."""
    try:
        import megatron.core  # noqa: F401
        from megatron.bridge import AutoBridge
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT}; import failed with: {e}") from e
    return AutoBridge


def _bridge_of(hf_model_or_dir: Any, dtype: torch.dtype | None) -> tuple[Any, Any]:
    """(an ``AutoBridge``, the HF model) from a loaded HF causal LM or a checkpoint directory."""
    AutoBridge = _require()
    from megatron.bridge.models.hf_pretrained.causal_lm import PreTrainedCausalLM

    if isinstance(hf_model_or_dir, (str, os.PathLike)):
        if not os.path.isdir(hf_model_or_dir):
            raise RequestError(
                f"{os.fspath(hf_model_or_dir)!r} is not a checkpoint directory", path="$.hf_model", rule="exists"
            )
        kwargs = {} if dtype is None else {"torch_dtype": dtype}
        bridge = AutoBridge.from_hf_pretrained(os.fspath(hf_model_or_dir), **kwargs)
        return bridge, bridge.hf_pretrained.model
    if not isinstance(hf_model_or_dir, torch.nn.Module) or not hasattr(hf_model_or_dir, "config"):
        raise RequestError(
            f"hf_model_or_dir must be an HF causal LM or a checkpoint directory, got {type(hf_model_or_dir).__name__}",
            path="$.hf_model",
            rule="type",
        )
    hf = hf_model_or_dir
    if not getattr(hf.config, "architectures", None):
        # Bridge picks its converter by architecture; a model built from a config has none yet.
        hf.config.architectures = [type(hf).__name__]
    wrapper = PreTrainedCausalLM()
    wrapper.model = hf
    wrapper.config = hf.config
    return AutoBridge(wrapper), hf


def _check_parallel_state(tp: Any) -> None:
    from megatron.core import parallel_state as ps

    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise RequestError(f"tp must be a positive int, got {tp!r}", path="$.tp", rule="range")
    if not torch.distributed.is_initialized() or not ps.model_parallel_is_initialized():
        raise RequestError(
            "from_hf needs torch.distributed and megatron.core.parallel_state.initialize_model_parallel"
            f"(tensor_model_parallel_size={tp}, pipeline_model_parallel_size=1) set up by the caller",
            path="$.parallel_state",
            rule="initialized",
        )
    have = ps.get_tensor_model_parallel_world_size()
    if have != tp or ps.get_pipeline_model_parallel_world_size() != 1:
        raise RequestError(
            f"tp={tp}, but parallel_state has tensor parallel size {have} and pipeline parallel size "
            f"{ps.get_pipeline_model_parallel_world_size()} (want {tp} and 1)",
            path="$.tp",
            rule="parallel_state",
        )


def _provider(bridge: Any, tp: int, dtype: torch.dtype, on_cuda: bool) -> Any:
    """The Bridge provider set up for tree rows (spec, parallel sizes, dtype, fusions), finalized."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.enums import AttnBackend

    from treepack.trainer.megatron.spec import tree_layer_spec

    prov = bridge.to_megatron_provider(load_weights=False)
    prov.transformer_layer_spec = tree_layer_spec
    # provide() swaps in Megatron's DotProductAttention when the backend is "local".
    if prov.attention_backend == AttnBackend.local:
        prov.attention_backend = AttnBackend.auto
    prov.tensor_model_parallel_size = tp
    prov.pipeline_model_parallel_size = 1
    prov.context_parallel_size = 1
    prov.params_dtype = dtype
    prov.bf16, prov.fp16 = dtype == torch.bfloat16, dtype == torch.float16
    prov.use_cpu_initialization = not on_cuda
    prov.perform_initialization = False
    prov.apply_rope_fusion = False
    if not on_cuda:
        for name in _CUDA_FUSIONS:
            setattr(prov, name, False)
        if prov.num_moe_experts and prov.moe_token_dispatcher_type == "alltoall":
            # The all-to-all dispatcher makes CUDA streams at build; all-gather routes the same tokens.
            prov.moe_token_dispatcher_type = "allgather"
    if prov.num_moe_experts and not getattr(bridge.hf_pretrained.config, "output_router_logits", False):
        # HF adds the router's load-balancing loss only with output_router_logits; without it
        # HF's step has none, and neither has the converted model's.
        prov.moe_aux_loss_coeff = 0.0
    prov._pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    prov.finalize()
    return prov


def _load_all(bridge: Any, model: torch.nn.Module) -> None:
    """Load the HF weights into ``model``, refusing it if Bridge left any parameter unloaded.

    Every parameter is NaN before the load (``perform_initialization`` is off, so it would
    otherwise hold whatever memory it got): a parameter with a NaN after it is one the
    conversion never wrote.
    """
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))
    bridge.load_hf_weights([model])
    left = [n for n, p in model.named_parameters() if bool(torch.isnan(p).any())]
    if left:
        why = "Megatron-Bridge's conversion left it unloaded (no HF weight mapped to it)"
        raise UnsupportedModelError(
            f"the Megatron model cannot run tree rows exactly: {len(left)} parameter(s) unloaded: {left[:6]}: {why}",
            rule="conversion",
            refusals=tuple((n, "Parameter", why) for n in left),
        )


def from_hf(
    hf_model_or_dir: Any, tp: int = 1, *, dtype: torch.dtype | None = None, device: Any = None
) -> torch.nn.Module:
    """A Megatron-Core ``GPTModel`` holding this TP rank's shard of an HF causal LM, ready for tree rows.

    Args:
        hf_model_or_dir: a loaded HF causal LM (e.g. ``LlamaForCausalLM``) or the directory
            of an HF checkpoint (``save_pretrained``'s output).
        tp: the tensor parallel size; must equal parallel_state's.
        dtype: parameter dtype (default: the HF model's).
        device: where the model lives (default: the current CUDA device when CUDA is
            available, else the CPU).

    Returns:
        The ``GPTModel`` (``model.config.vocab_size`` is the unpadded vocabulary, the output
        layer holds ``padded_vocab // tp`` rows on each TP rank), in training mode.

    Raises:
        ImportError: Megatron-Core or Megatron-Bridge missing (names what to install).
        RequestError: parallel_state not set up for ``tp``.
        UnsupportedModelError: the model cannot run tree rows exactly (each refusal named).
    """
    bridge, hf = _bridge_of(hf_model_or_dir, dtype)
    _check_parallel_state(tp)
    from treepack.trainer.megatron.rope import TreeRotaryEmbedding, hf_inv_freq
    from treepack.trainer.megatron.spec import check_megatron_model, config_refusals, refuse

    inv_freq = hf_inv_freq(hf)
    want = dtype or next(hf.parameters()).dtype
    dev = torch.device(device) if device is not None else None
    if dev is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    prov = _provider(bridge, tp, want, dev.type == "cuda")
    refuse(config_refusals(prov))
    model = prov.provide()
    _load_all(bridge, model)
    if model.position_embedding_type == "rope":
        rot = model.rotary_pos_emb
        if getattr(rot, "rotary_interleaved", False):
            raise UnsupportedModelError(
                "interleaved RoPE is not checked against HF",
                rule="rope",
                refusals=(("rotary_pos_emb", type(rot).__name__, "interleaved RoPE"),),
            )
        model.rotary_pos_emb = TreeRotaryEmbedding(inv_freq)
    model = model.to(dev)
    check_megatron_model(model)
    return model.train()
