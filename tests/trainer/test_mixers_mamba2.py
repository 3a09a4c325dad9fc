"""The oracle for the Mamba2 hybrids: Bamba, Nemotron-H, Granite-4 (GraniteMoeHybrid), Falcon-H1 (+ Mamba2, Zamba2).

Tiny random fp32 models on CPU, packed (mixers patched by mechanism) against every
sequence run alone through the stock model: logprobs <= 1e-5, gradients <= 1e-4 relative,
a leaf loss reaches nothing off its chain, and the negative control (mixers stock: each
row one linear scan) differs. Each model scans in chunks of 16, so the trees' segments
cross both 16- and 64-token chunk boundaries and branch inside chunks.
"""

from __future__ import annotations

import math

import pytest
import torch

from treepack.trainer.hf.admission.guards import trust_hook
from treepack.trainer.hf.layers import is_handled, mixer_kind, patch_layers

from helpers.mixers import VOCAB, assert_oracle, mixer_case, run_oracle

CHUNK = 16
MAMBA = dict(
    mamba_n_heads=4,
    mamba_d_head=8,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_expand=1,
    mamba_chunk_size=CHUNK,
)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    initializer_range=0.08,
)


def _long_memory(model) -> None:
    """Slow decay (small A, small dt), so the state carries far and a wrong fork point shows."""
    with torch.no_grad():
        for mod in model.modules():
            if mixer_kind(mod) == "mamba2":
                mod.A_log.uniform_(math.log(0.02), math.log(0.2))
                mod.dt_bias.uniform_(-3.0, -1.0)
                mod.D.uniform_(0.5, 1.5)


def bamba():
    from transformers import BambaConfig, BambaForCausalLM

    return BambaForCausalLM(BambaConfig(**COMMON, **MAMBA, num_hidden_layers=3, attn_layer_indices=[1]))


def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        **{k: v for k, v in COMMON.items()},
        layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"],
        head_dim=16,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=CHUNK,
        use_conv_bias=True,
        time_step_min=0.001,
    )
    return NemotronHForCausalLM(cfg)


def granite_hybrid():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        **COMMON,
        **MAMBA,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        embedding_multiplier=2.0,
        residual_multiplier=0.7,
        attention_multiplier=0.2,
        logits_scaling=1.5,
    )
    return GraniteMoeHybridForCausalLM(cfg)


def falcon_h1(rms_norm: bool = True):
    from transformers import FalconH1Config, FalconH1ForCausalLM

    cfg = FalconH1Config(
        **COMMON,
        **MAMBA,
        num_hidden_layers=2,
        mamba_rms_norm=rms_norm,
        mamba_d_ssm=32,
        ssm_in_multiplier=0.8,
        ssm_out_multiplier=1.3,
        ssm_multipliers=[0.9, 1.1, 0.7, 1.2, 0.6],
        attention_in_multiplier=0.9,
        attention_out_multiplier=1.1,
        key_multiplier=0.8,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.7,
        mlp_multipliers=[0.9, 1.2],
    )
    return FalconH1ForCausalLM(cfg)


def mamba2_pure():
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return Mamba2ForCausalLM(
        Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=16,
            n_groups=2,
            state_size=8,
            conv_kernel=4,
            chunk_size=CHUNK,
            expand=2,
        )
    )


def zamba2():
    from transformers import Zamba2Config, Zamba2ForCausalLM

    cfg = Zamba2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=3,
        layers_block_type=["mamba", "hybrid", "mamba"],
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=2,
        mamba_headdim=8,
        n_mamba_heads=8,
        chunk_size=CHUNK,
        num_attention_heads=2,
        num_key_value_heads=2,
        attention_head_dim=16,
        intermediate_size=48,
        max_position_embeddings=512,
        use_shared_attention_adapter=False,
    )
    return Zamba2ForCausalLM(cfg)


FAMILIES = {
    "bamba": (bamba, 2),
    "nemotron_h": (nemotron_h, 2),
    "granite_moe_hybrid": (granite_hybrid, 2),
    "falcon_h1": (falcon_h1, 2),
    "falcon_h1_no_norm": (lambda: falcon_h1(rms_norm=False), 2),
    # Not named anywhere in the patches: their mixers run the same code as a stock one.
    "mamba2": (mamba2_pure, 2),
    "zamba2": (zamba2, 3),
}


@pytest.fixture(scope="module")
def case():
    return mixer_case(conv_width=4, chunk=CHUNK)


def _build(name):
    factory, n_mixers = FAMILIES[name]
    torch.manual_seed(0)
    model = factory().float().eval()
    model.set_attn_implementation("eager")
    _long_memory(model)
    return model, n_mixers


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_mamba2_family_oracle(name, case):
    model, n_mixers = _build(name)
    mixers = [n for n, m in model.named_modules() if mixer_kind(m) == "mamba2"]
    assert len(mixers) == n_mixers and all(is_handled(m) for m in model.modules() if mixer_kind(m))
    assert patch_layers(model) == mixers
    figures = run_oracle(model, case, model.get_input_embeddings())
    print(f"\n{name}: {figures}")
    assert_oracle(figures)


def test_subclass_with_another_forward_is_not_handled():
    from transformers.models.bamba.modeling_bamba import BambaMixer

    class Scaled(BambaMixer):
        def forward(self, hidden_states, cache=None, attention_mask=None, **kwargs):
            return 2 * super().forward(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)

    class Renamed(BambaMixer):  # inherits the stock forward: the same computation
        pass

    model, _ = _build("bamba")
    cfg, idx = model.config, 0
    assert mixer_kind(Scaled(cfg, idx)) == "mamba2" and not is_handled(Scaled(cfg, idx))
    assert is_handled(Renamed(cfg, idx))


def test_activation_checkpointing_replays_the_tree_mixers(case):
    """Recomputation in backward (outside packed_forward) still runs the tree scan: same gradients."""
    from treepack.trainer.hf import packed_forward

    _, _, _, batch = case
    model, _ = _build("bamba")
    patch_layers(model)
    params = list(model.parameters())
    calls = []
    hooks = [
        m.register_forward_hook(trust_hook(lambda *a: calls.append(1)))
        for m in model.modules()
        if mixer_kind(m) == "mamba2"
    ]

    def grads():
        lp = torch.log_softmax(
            packed_forward(model, batch, backend="sdpa", verify=False).float(), -1
        )  # counts calls; checks exactness itself
        loss = lp.reshape(-1, lp.shape[-1])[batch.score_flat].gather(1, batch.score_target[:, None]).sum()
        return torch.autograd.grad(loss, params, allow_unused=True)

    try:
        plain = grads()
        n_plain = len(calls)
        model.train()
        model.activation_checkpointing_enable()
        ckpt = grads()
    finally:
        model.activation_checkpointing_disable()
        model.eval()
        for h in hooks:
            h.remove()
    assert len(calls) == 3 * n_plain, "the mixers were not recomputed in backward"
    for a, b in zip(plain, ckpt):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
