"""Recurrent and conv mixers under context parallelism, on 2 and 4 gloo CPU ranks.

Every rank materializes its shard of every row, runs ``packed_forward`` (Ulysses attention
and each mixer kind's shard forward: projections on the shard, conv and tree scan on whole
rows of ``H / cp`` heads or channels after an all-to-all, then back), takes its shard's
PPO-clip loss (normalized over the whole batch) and backward. The losses summed and the
gradients summed over the group must equal one process running whole rows (logprobs 1e-5
absolute, gradients 1e-5 relative to each parameter's largest gradient), for a GDN hybrid
(Qwen3.5, Qwen3-Next, OLMo-hybrid), Bamba (Mamba2), Jamba (Mamba), LFM2 (short conv),
Kimi-Linear (KDA), DeepSeek-V3.2 (DSA and its indexer) and GLM-MoE-DSA (a layer sharing the
previous layer's picks). Negative control per family: the mixers'
whole rows hold only this rank's own shard (the other ranks' positions zero: no parent
state, no conv context, no remote keys from earlier shards), and the logprobs differ.
Layers whose heads or channels do not divide over the ranks are refused by name before
compute.
"""

from __future__ import annotations

import functools
import json
import math
import os

import pytest
import torch

from helpers import cp_oracle as oracle
from helpers.ranks import run_ranks
from helpers.trainer_cases import VOCAB

TIMEOUT_S = 480  # a deadlock guard, not a speed check: 4 ranks on a loaded 2-core machine take minutes
# (CP ranks, families): one spawn per group size (process start and imports dominate).
CASES = [
    (2, ("qwen3_5", "qwen3_next", "olmo_hybrid", "glm_moe_dsa")),
    (2, ("bamba", "jamba", "lfm2", "kimi_linear", "deepseek_v32")),
    (4, ("qwen3_5", "bamba", "deepseek_v32")),
    (4, ("jamba", "lfm2", "kimi_linear")),
]
# The layer modules whose shard forwards may move tensors with their own seq_to_heads / gather_seq.
MIXER_MODULES = ("gdn", "gdn_olmo", "kda", "mamba2", "mamba", "short_conv", "dsa")


def _seeded(build):
    from treepack.trainer.hf.layers import mixer_kind

    torch.manual_seed(0)
    model = build().float().eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():  # slow decay: the state carries across shard boundaries, so a missing parent state shows
        for m in model.modules():
            kind = mixer_kind(m)
            if kind in ("gdn", "gdn_olmo", "mamba", "mamba2"):
                m.A_log.uniform_(math.log(0.02), math.log(0.3))
            if kind == "mamba2":
                m.dt_bias.uniform_(-3.0, -1.0)
            if kind == "mamba":
                m.dt_proj.bias.uniform_(-3.0, -1.0)
            if kind == "kda":
                m.forget_gate.A_log.uniform_(math.log(0.02), math.log(0.3))
                m.forget_gate.dt_bias.uniform_(-3.0, -1.0)
    return model


def qwen3_5(value_heads: int = 4):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=value_heads,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        initializer_range=0.08,
        max_position_embeddings=512,
    )
    return Qwen3_5ForCausalLM(cfg)


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        initializer_range=0.08,
        max_position_embeddings=512,
    )
    return Qwen3NextForCausalLM(cfg)


def olmo_hybrid():
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    cfg = OlmoHybridConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        max_position_embeddings=512,
        initializer_range=0.08,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return OlmoHybridForCausalLM(cfg)


def bamba(n_groups: int = 2):
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        attn_layer_indices=[1],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=n_groups,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=16,
        max_position_embeddings=512,
        initializer_range=0.08,
    )
    return BambaForCausalLM(cfg)


def jamba():
    from transformers import JambaConfig, JambaForCausalLM

    cfg = JambaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=4,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_dt_rank=8,
        max_position_embeddings=512,
        initializer_range=0.08,
    )
    return JambaForCausalLM(cfg)


def lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        layer_types=["conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_L_cache=3,
        max_position_embeddings=512,
        initializer_range=0.08,
    )
    return Lfm2ForCausalLM(cfg)


def kimi_linear():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    cfg = KimiLinearConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        layer_types=["linear_attention", "full_attention"],
        linear_head_dim=8,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=512,
        initializer_range=0.08,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return KimiLinearForCausalLM(cfg)


def deepseek_v32():
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    from treepack.trainer.hf.layers import patch_layers

    cfg = DeepseekV32Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=4,
        initializer_range=0.08,
        max_position_embeddings=512,
    )
    model = DeepseekV32ForCausalLM(cfg)
    patch_layers(model)  # the indexers' position tie-break, as test_sparse_hf
    return model


def glm_moe_dsa():
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    from treepack.trainer.hf.layers import patch_layers

    cfg = GlmMoeDsaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        index_topk=8,
        index_head_dim=16,
        index_n_heads=4,
        initializer_range=0.08,
        max_position_embeddings=512,
        indexer_types=["full", "shared"],
    )
    model = GlmMoeDsaForCausalLM(cfg)
    patch_layers(model)
    return model


FAMILIES = {
    "glm_moe_dsa": glm_moe_dsa,
    "deepseek_v32": deepseek_v32,
    "qwen3_5": qwen3_5,
    "qwen3_next": qwen3_next,
    "olmo_hybrid": olmo_hybrid,
    "bamba": bamba,
    "jamba": jamba,
    "lfm2": lfm2,
    "kimi_linear": kimi_linear,
}
# A model each group size must refuse by name: (builder, module class, reason fragment).
REFUSED = {4: (lambda: qwen3_5(value_heads=6), "Qwen3_5GatedDeltaNet", "6 value heads do not divide over 4")}


def _own_shard_only(cp, shard_len):
    """Negative control: the mixers' whole rows keep this rank's own positions only.

    Replaces the all-to-all into whole rows of the mixer helpers
    (:mod:`treepack.trainer.kernels.cp`: ``seq_to_heads`` as read by ``rows_of_heads`` and
    ``tree_conv_heads``; attention imports its own) and the layer modules' own
    ``seq_to_heads`` and ``gather_seq`` of values (DSA's keys and indexer keys, Mamba's B
    and C; DSA's gathered picks stay whole, so the control's difference is the missing keys).
    """
    from treepack.trainer.kernels import cp as cpk

    def keep(y, dim):
        pos = torch.arange(y.shape[dim])
        mine = (pos >= cp.rank * shard_len) & (pos < (cp.rank + 1) * shard_len)
        return y * mine.reshape(-1, *(1,) * (y.dim() - dim - 1)).to(y.dtype)

    seq_to_heads, gather_seq = cpk.seq_to_heads, cpk.gather_seq
    return {
        "seq_to_heads": lambda x, cp_: keep(seq_to_heads(x, cp_), 2),
        "gather_seq": lambda x, cp_: keep(gather_seq(x, cp_), 1) if x.is_floating_point() else gather_seq(x, cp_),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    import importlib

    from treepack.proto.errors import UnsupportedModelError
    from treepack.trainer.hf import packed_forward

    cfg = json.load(open(os.path.join(out_dir, "world.json")))
    world, families = cfg["world"], cfg["families"]
    with oracle.gloo_group(rank, port, world, timeout_s=120):
        s = oracle.shard_mixed_batch(world)
        mine = s.mine
        result = {**oracle.shard_record(s), "families": {}}
        for family in families:
            ref = oracle.reference_step(functools.partial(_seeded, FAMILIES[family]), s)
            model = _seeded(FAMILIES[family])
            step = oracle.step_record(model, s, ref)
            mods = [importlib.import_module("treepack.trainer.kernels.cp")] + [
                importlib.import_module(f"treepack.trainer.hf.layers.{m}") for m in MIXER_MODULES
            ]
            saved = [(mods[0], {"seq_to_heads": mods[0].seq_to_heads})]
            saved += [
                (m, {k: getattr(m, k) for k in ("seq_to_heads", "gather_seq") if hasattr(m, k)}) for m in mods[1:]
            ]
            control = _own_shard_only(s.cp, s.plan.ranks.shard_len)
            try:
                for m, names in saved:
                    for k in names:
                        setattr(m, k, control[k])
                with torch.no_grad():
                    ctl_lp = mine.unpack_logprobs(packed_forward(model, mine, verify=False))
            finally:
                for m, names in saved:
                    for k, v in names.items():
                        setattr(m, k, v)
            result["families"][family] = {**step, "control_lp_diff": oracle.lp_diff(ctl_lp, ref.lp)}
        if world in REFUSED:
            build, cls, why = REFUSED[world]
            try:
                packed_forward(_seeded(build), mine, verify=False)
                result["refused"] = "ran"
            except UnsupportedModelError as e:
                result["refused"] = str(e)
        oracle.write_result(out_dir, rank, result)


@pytest.mark.parametrize("world,families", CASES, ids=[f"cp{w}-{'-'.join(f)}" for w, f in CASES])
def test_cp_mixers_match_one_process(tmp_path, world, families):
    (tmp_path / "world.json").write_text(json.dumps({"world": world, "families": families}))
    results = run_ranks(_worker, tmp_path, TIMEOUT_S, nprocs=world)
    for r in results:
        oracle.assert_shard_size(r, world)
        if world in REFUSED:
            _, cls, why = REFUSED[world]
            assert cls in r["refused"] and why in r["refused"], r["refused"]
        assert sorted(r["families"]) == sorted(families)
        for family, f in r["families"].items():
            oracle.assert_step_matches(f, r["shard_len"], family)
            assert f["control_lp_diff"] > oracle.CONTROL_GAP, (family, f)  # the other ranks' positions matter
    for family in families:
        oracle.assert_same_summed_loss([r["families"][family] for r in results])
