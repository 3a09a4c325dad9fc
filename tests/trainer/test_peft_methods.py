"""Every PEFT method of the installed PEFT, and every LoRA variant, is exact on tree rows or refused by name.

One test per ``PeftType`` (and per LoRA variant): an exact method's packed logprobs and
adapter gradients equal every sequence run alone through the same ``PeftModel`` (a tiny
Qwen3, or Llama where PEFT supports only that, its trainable parameters moved off their
init); a refused one raises ``UnsupportedModelError`` naming the adapter, the method and
why, before the model runs. The classification tests fail when PEFT gains a method type or
a LoRA variant that :mod:`treepack.trainer.hf.admission.peft_checks` does not classify, and
docs/models.md's PEFT table is the module's table. Negative controls: with the check
bypassed, aLoRA, Lily and ShadowPEFT are silently wrong and prompt tuning crashes
mid-forward; an
unclassified method or variant is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import materialize, naive_varlen_attention
from treepack.trainer.hf import packed_forward
from treepack.trainer.hf.admission import peft_checks, trust_hook
from treepack.trainer.hf.admission.peft_checks import LORA_VARIANTS, PEFT_METHODS

from helpers.extras import require
from helpers.tolerance import assert_close, assert_not_close
from helpers.trainer_cases import mixed_batch, plan_of, reference_logprobs, tiny_model, trainable_flags

peft = require("peft")

T = ["q_proj", "v_proj", "down_proj"]
S0 = mixed_batch()["sequences"][0]  # its tokens pick aLoRA's invocation (deterministic)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "models.md"
BEGIN, END = "<!-- peft-methods:begin -->", "<!-- peft-methods:end -->"


@dataclass(frozen=True)
class Case:
    """How one method's tiny model is built: ``config(tmp)`` -> a PeftConfig (or, with
    ``build``, the whole PeftModel), the base family, the mode the oracle runs in."""

    config: Callable[[Path], Any] | None = None
    family: str = "qwen3"
    mode: str = "train"
    build: Callable[[torch.nn.Module, Path], Any] | None = None
    backends: tuple[str, ...] = ("sdpa",)
    grads: bool = True
    extra: dict = field(default_factory=dict)


def _lora(**kw: Any) -> Callable[[Path], Any]:
    return lambda tmp: peft.LoraConfig(r=4, target_modules=T, task_type="CAUSAL_LM", **kw)


def _saved_loras(tmp: Path, n: int, tag: str) -> list[str]:
    paths = []
    for i in range(n):
        torch.manual_seed(20 + i)
        m = peft.get_peft_model(tiny_model("qwen3"), peft.LoraConfig(r=4, target_modules=T, init_lora_weights=False))
        paths.append(str(tmp / f"{tag}{i}"))
        m.save_pretrained(paths[-1])
    return paths


def _xlora(tmp: Path) -> Any:
    adapters = dict(enumerate(_saved_loras(tmp, 2, "xlora")))
    return peft.XLoraConfig(
        task_type="CAUSAL_LM",
        hidden_size=32,
        adapters={str(k): v for k, v in adapters.items()},
        xlora_depth=1,
        use_trainable_adapters=True,
    )


def _arrow(base: torch.nn.Module, tmp: Path) -> Any:
    from peft.tuners.lora.arrow import create_arrow_model
    from peft.tuners.lora.config import ArrowConfig

    return create_arrow_model(base, _saved_loras(tmp, 2, "arrow"), ArrowConfig(top_k=1))


def _lora_sub(name: str, **kw: Any) -> Any:
    from peft.tuners.lora import config as lora_config

    return getattr(lora_config, name)(**kw)


# Every exact PeftType, and every exact LoRA variant (by class name), with its case.
EXACT: dict[str, Case] = {
    "LORA": Case(_lora(), backends=("sdpa", "flash")),
    "ADALORA": Case(lambda tmp: peft.AdaLoraConfig(r=4, target_modules=T, total_step=10, task_type="CAUSAL_LM")),
    "ADAMSS": Case(lambda tmp: peft.AdamssConfig(target_modules=T, task_type="CAUSAL_LM")),
    "ADAPTION_PROMPT": Case(
        lambda tmp: peft.AdaptionPromptConfig(adapter_len=4, adapter_layers=2, task_type="CAUSAL_LM"),
        family="llama",
        backends=("sdpa", "flash"),
    ),
    "BEFT": Case(lambda tmp: peft.BeftConfig(target_modules=T, task_type="CAUSAL_LM")),
    "BOFT": Case(lambda tmp: peft.BOFTConfig(target_modules=["q_proj"], boft_block_size=4, task_type="CAUSAL_LM")),
    "C3A": Case(lambda tmp: peft.C3AConfig(target_modules=T, block_size=16, task_type="CAUSAL_LM")),
    "DEFT": Case(lambda tmp: peft.DeftConfig(target_modules=T, task_type="CAUSAL_LM")),
    "DELORA": Case(lambda tmp: peft.DeloraConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "FOURIERFT": Case(lambda tmp: peft.FourierFTConfig(target_modules=T, n_frequency=16, task_type="CAUSAL_LM")),
    "FROD": Case(lambda tmp: peft.FrodConfig(target_modules=T, task_type="CAUSAL_LM")),
    "GLORA": Case(lambda tmp: peft.GloraConfig(target_modules=T, task_type="CAUSAL_LM")),
    "GRALORA": Case(lambda tmp: peft.GraloraConfig(r=4, gralora_k=2, target_modules=T, task_type="CAUSAL_LM")),
    "HIRA": Case(lambda tmp: peft.HiraConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "HRA": Case(lambda tmp: peft.HRAConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "IA3": Case(
        lambda tmp: peft.IA3Config(
            target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM"
        )
    ),
    "LN_TUNING": Case(lambda tmp: peft.LNTuningConfig(target_modules=["input_layernorm", "norm"])),
    "LOHA": Case(lambda tmp: peft.LoHaConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "LOKR": Case(lambda tmp: peft.LoKrConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "MISS": Case(lambda tmp: peft.MissConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "OFT": Case(lambda tmp: peft.OFTConfig(oft_block_size=4, target_modules=T, task_type="CAUSAL_LM")),
    "SHIRA": Case(lambda tmp: peft.ShiraConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "OSF": Case(lambda tmp: peft.OSFConfig(target_modules=T, task_type="CAUSAL_LM")),
    "PEANUT": Case(lambda tmp: peft.PeanutConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "PSOFT": Case(lambda tmp: peft.PsoftConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "PVERA": Case(lambda tmp: peft.PveraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM"), mode="eval"),
    "RANDLORA": Case(lambda tmp: peft.RandLoraConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "ROAD": Case(lambda tmp: peft.RoadConfig(target_modules=T, group_size=8, task_type="CAUSAL_LM")),
    "SUPERTUNING": Case(lambda tmp: peft.SupertuningConfig(target_modules=T, task_type="CAUSAL_LM")),
    "TINYLORA": Case(lambda tmp: peft.TinyLoraConfig(target_modules=T, task_type="CAUSAL_LM")),
    "TRAINABLE_TOKENS": Case(
        lambda tmp: peft.TrainableTokensConfig(target_modules=["embed_tokens"], token_indices=[1, 5, 9, 30, 44])
    ),
    "UNILORA": Case(lambda tmp: peft.UniLoraConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "VBLORA": Case(
        lambda tmp: peft.VBLoRAConfig(r=4, target_modules=T, vector_length=8, num_vectors=16, task_type="CAUSAL_LM")
    ),
    "VERA": Case(lambda tmp: peft.VeraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")),
    "WAVEFT": Case(lambda tmp: peft.WaveFTConfig(target_modules=T, n_frequency=16, task_type="CAUSAL_LM")),
    "XLORA": Case(_xlora, backends=("sdpa", "flash")),
    # LoRA variants
    "DoraLinearVariant": Case(_lora(use_dora=True)),
    "DoraEmbeddingVariant": Case(
        lambda tmp: peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], use_dora=True)
    ),
    "ArrowLinearVariant": Case(build=_arrow, grads=False, mode="eval"),  # task adapters frozen: nothing trains
    "BdLoraLinearVariant": Case(
        _lora(
            use_bdlora=_lora_sub(
                "BdLoraConfig", target_modules_bd_a=["q_proj"], target_modules_bd_b=["v_proj", "down_proj"]
            )
        )
    ),
    "VeloraLinearVariant": Case(_lora(velora_config=_lora_sub("VeloraConfig", num_groups=4, init_type="random"))),
    "MontecloraLinearVariant": Case(_lora(monteclora_config=_lora_sub("MontecloraConfig")), mode="eval"),
    "MiCALinearVariant": Case(_lora(init_lora_weights="mica")),
    "MiCAEmbeddingVariant": Case(
        lambda tmp: peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"], init_lora_weights="mica")
    ),
    "KasaLinearVariant": Case(_lora(kasa_config=_lora_sub("KasaConfig"))),
    # aLoRA: the invocation in sequence 0's completion only (on from there for it, off for the
    # others of its row), and in the prompt the first tree's sequences share (on from there for all).
    "ALoraLinearVariant": Case(_lora(alora_invocation_tokens=[int(S0[22]), int(S0[23])]), backends=("sdpa", "flash")),
    "ALoraLinearVariant-prompt": Case(_lora(alora_invocation_tokens=[int(S0[3]), int(S0[4])])),
}


def _prompt_config(cls_name: str, **kw: Any) -> Callable[[Path], Any]:
    return lambda tmp: getattr(peft, cls_name)(num_virtual_tokens=4, task_type="CAUSAL_LM", **kw)


# Every refused PeftType and refused LoRA variant that can be built here, with its case.
REFUSED: dict[str, Case] = {
    "PROMPT_TUNING": Case(_prompt_config("PromptTuningConfig")),
    "MULTITASK_PROMPT_TUNING": Case(_prompt_config("MultitaskPromptTuningConfig", num_tasks=2)),
    "P_TUNING": Case(_prompt_config("PromptEncoderConfig", encoder_hidden_size=16)),
    "PREFIX_TUNING": Case(_prompt_config("PrefixTuningConfig")),
    "CARTRIDGE": Case(_prompt_config("CartridgeConfig")),
    "CPT": Case(
        lambda tmp: peft.CPTConfig(
            cpt_token_ids=[1, 2, 3, 4], cpt_mask=[1, 1, 1, 1], cpt_tokens_type_mask=[1, 2, 2, 2], task_type="CAUSAL_LM"
        )
    ),
    "POLY": Case(lambda tmp: peft.PolyConfig(r=4, target_modules=T, n_tasks=2, task_type="CAUSAL_LM")),
    "LILY": Case(lambda tmp: peft.LilyConfig(r=4, target_modules=T, task_type="CAUSAL_LM")),
    "SHADOW": Case(lambda tmp: peft.ShadowConfig(task_type="CAUSAL_LM", shadow_dropout=0.0)),
}
# Refused without a case: only buildable on bases this environment does not have.
REFUSED_UNBUILT = {
    "QALoraLinearVariant": "needs a GPTQ-quantized base",
    "DoraConv1dVariant": "a Conv1d target",
    "DoraConv2dVariant": "a Conv2d target",
    "DoraConv3dVariant": "a Conv3d target",
}


@pytest.fixture(scope="module")
def case():
    c = mixed_batch()
    return c, materialize(plan_of(c), c["sequences"]), trainable_flags(c)


def _build(name: str, spec: Case, tmp: Path) -> Any:
    torch.manual_seed(0)
    base = tiny_model(spec.family)
    base.config.use_cache = False  # X-LoRA asks for it
    model = spec.build(base, tmp) if spec.build is not None else peft.get_peft_model(base, spec.config(tmp))
    model.train() if spec.mode == "train" else model.eval()
    torch.manual_seed(1)
    with torch.no_grad():  # off their init (LoRA's B = 0 would make the adapter vanish)
        for p in model.parameters():
            if p.requires_grad and p.is_floating_point():
                p.add_(0.05 * torch.randn_like(p))
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _packed_logprobs(model: Any, batch: Any, backend: str) -> torch.Tensor:
    kw = {"varlen_fn": naive_varlen_attention} if backend == "flash" else {}
    return batch.target_logprobs(packed_forward(model, batch, backend=backend, verify=False, **kw))


def test_every_peft_type_of_the_installed_peft_is_classified_and_tested():
    """Fails when PEFT adds a method type: it must be classified exact or refused (with its test)."""
    kinds = {t.value for t in peft.PeftType}
    assert sorted(kinds - set(PEFT_METHODS)) == [], "PEFT method types neither exact nor refused"
    assert sorted(set(PEFT_METHODS) - kinds) == [], "classified method types this PEFT does not have"
    tested = {k for k in EXACT if k in kinds} | {k for k in REFUSED if k in kinds}
    assert sorted(kinds - tested) == [], "method types without a test"
    for kind, method in PEFT_METHODS.items():
        assert (method.status == "exact") == (kind in EXACT), kind


def _variant_classes() -> set[str]:
    from peft.tuners.lora import variants  # noqa: F401 - defines every variant class
    from peft.tuners.lora.layer import LoraVariant

    out, stack = set(), [LoraVariant]
    while stack:
        for sub in stack.pop().__subclasses__():
            stack.append(sub)
            if not sub.__name__.startswith("_"):
                out.add(sub.__name__)
    return out


def test_every_lora_variant_of_the_installed_peft_is_classified_and_tested():
    """Fails when PEFT adds a LoRA variant (the way aLoRA came): exact or refused, with its test."""
    found = _variant_classes()
    assert sorted(found - set(LORA_VARIANTS)) == [] and sorted(set(LORA_VARIANTS) - found) == []
    for name, method in LORA_VARIANTS.items():
        if method.status == "exact":
            assert name in EXACT, name
        else:
            assert name in REFUSED or name in REFUSED_UNBUILT, name


@pytest.mark.parametrize("name,backend", [(n, b) for n, c in EXACT.items() for b in c.backends], ids=lambda x: str(x))
def test_exact_method_equals_each_sequence_alone(case, tmp_path, name, backend):
    c, batch, flags = case
    spec = EXACT[name]
    model = _build(name, spec, tmp_path)
    ref = reference_logprobs(model, c["sequences"], flags)
    if spec.grads:
        sum(torch.nansum(x) for x in ref).backward()
    want = _grads(model)
    assert not spec.grads or want, "nothing trains: the gradient comparison would be empty"
    with torch.set_grad_enabled(spec.grads):
        lp = _packed_logprobs(model, batch, backend)
    if spec.grads:
        lp.sum().backward()
    assert_close(f"{name} logprobs", [x.detach() for x in ref], batch.unpack_logprobs(lp.detach()), atol=1e-5)
    assert_close(f"{name} grads", want, _grads(model), atol=1e-7, ratio=1e-4, nonzero_ref=True)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_method_is_refused_by_name_before_the_model_runs(case, tmp_path, name):
    _, batch, _ = case
    model = _build(name, REFUSED[name], tmp_path)
    kind = name if name in PEFT_METHODS else None
    calls: list[int] = []
    handle = model.get_base_model().register_forward_pre_hook(trust_hook(lambda m, a: calls.append(1)))
    try:
        with pytest.raises(UnsupportedModelError) as err:
            packed_forward(model, batch, verify=False)
    finally:
        handle.remove()
    assert calls == []
    why = PEFT_METHODS[kind].why if kind else LORA_VARIANTS[name].why
    assert any(why in reason for _, _, reason in err.value.refusals), err.value.refusals
    if kind:  # named by the adapter and its config class
        assert ("peft_config['default']", type(model.peft_config["default"]).__name__) in {
            (p, c) for p, c, _ in err.value.refusals
        }


def _unchecked(monkeypatch):
    """Negative controls only: the packed call without the PEFT check."""
    import importlib

    admit = importlib.import_module("treepack.trainer.hf.admission.admit")  # the module, not the function
    monkeypatch.setattr(admit, "peft_refusals", lambda model, hf: [])


@pytest.mark.parametrize("name", ["LILY", "SHADOW"])
def test_negative_control_refused_methods_are_silently_wrong_unchecked(case, tmp_path, monkeypatch, name):
    """What the refusal prevents: Lily (its router averages over the whole call) and ShadowPEFT (its
    backbone attends over the whole row, here on flash) give other logprobs than each sequence alone."""
    c, batch, flags = case
    model = _build(name, REFUSED[name], tmp_path)
    with torch.no_grad():
        ref = reference_logprobs(model, c["sequences"], flags)
        _unchecked(monkeypatch)
        got = batch.unpack_logprobs(_packed_logprobs(model, batch, "flash" if name == "SHADOW" else "sdpa"))
    assert_not_close(f"{name} unchecked", ref, got, atol=1e-3)


def test_negative_control_alora_with_peft_s_own_offsets_is_wrong(case, tmp_path, monkeypatch):
    """Without the per-sequence activation PEFT finds the invocation once per packed row (from
    sequence 0's completion on, for every later sequence of its row): other logprobs than alone."""
    import importlib

    c, batch, flags = case
    model = _build("ALoraLinearVariant", EXACT["ALoraLinearVariant"], tmp_path)
    with torch.no_grad():
        ref = reference_logprobs(model, c["sequences"], flags)
        monkeypatch.setattr(importlib.import_module("treepack.trainer.hf.run"), "alora_inputs", lambda m, b: {})
        got = batch.unpack_logprobs(_packed_logprobs(model, batch, "sdpa"))
    assert_not_close("aLoRA with PEFT's per-row offsets", ref, got, atol=1e-2)


def test_alora_sharers_that_disagree_are_refused_and_alora_keys_split_them(tmp_path):
    """A prompt holding the invocation, shared by a completion that holds it again (on from its own
    later match) and one that does not (on from the prompt's): refused before the model runs,
    naming both; planned with alora_keys the two no longer share those positions, and run exact."""
    import numpy as np

    from treepack.proto.errors import RequestError
    from treepack.trainer.hf.alora import alora_keys

    rng = np.random.default_rng(5)
    inv = [7, 8]
    prompt = np.concatenate([rng.integers(10, 97, 6), inv, rng.integers(10, 97, 8)])
    seqs = [
        np.concatenate([prompt, rng.integers(10, 97, 3), inv, rng.integers(10, 97, 3)]),
        np.concatenate([prompt, rng.integers(10, 97, 8)]),
    ]
    c = dict(sequences=seqs, trainable=[16, 16], groups=[0, 0], seq_len=64, min_shared_len=4)
    model = _build("aLoRA", Case(_lora(alora_invocation_tokens=inv)), tmp_path)
    with pytest.raises(RequestError, match=r"aLoRA activation: sequences 1 and 0 share row position"):
        packed_forward(model, materialize(plan_of(c), seqs), verify=False)
    keyed = materialize(plan_of(c, keys=alora_keys(seqs, inv)), seqs)
    ref = reference_logprobs(model, seqs, trainable_flags(c))
    with torch.no_grad():
        got = keyed.unpack_logprobs(_packed_logprobs(model, keyed, "sdpa"))
    assert_close("aLoRA planned with alora_keys", ref, got, atol=1e-5)
    assert int(keyed.plan.stats.tree_tokens) < sum(len(s) for s in seqs)  # still shares the prompt's start


def test_negative_control_prompt_tuning_unchecked_crashes_mid_forward(case, tmp_path, monkeypatch):
    _, batch, _ = case
    model = _build("PROMPT_TUNING", REFUSED["PROMPT_TUNING"], tmp_path)
    _unchecked(monkeypatch)
    with pytest.raises(Exception) as err:
        _packed_logprobs(model, batch, "sdpa")
    assert not isinstance(err.value, UnsupportedModelError)


def test_a_method_type_or_variant_treepack_does_not_know_is_refused(case, tmp_path, monkeypatch):
    """Fail closed at run time too: a PEFT method or LoRA variant missing from the tables (a newer
    PEFT) is refused naming it; the same model with the tables whole runs (the control)."""
    _, batch, _ = case
    model = _build("DoraLinearVariant", EXACT["DoraLinearVariant"], tmp_path)
    with torch.no_grad():
        packed_forward(model, batch, verify=False)
    methods = {k: v for k, v in PEFT_METHODS.items() if k != "LORA"}
    monkeypatch.setattr(peft_checks, "PEFT_METHODS", methods)
    with pytest.raises(UnsupportedModelError, match="PEFT method LORA is not known to treepack"):
        packed_forward(model, batch, verify=False)
    monkeypatch.setattr(peft_checks, "PEFT_METHODS", PEFT_METHODS)
    variants = {k: v for k, v in LORA_VARIANTS.items() if k != "DoraLinearVariant"}
    monkeypatch.setattr(peft_checks, "LORA_VARIANTS", variants)
    with pytest.raises(UnsupportedModelError, match="LoRA variant DoraLinearVariant .* is not known to treepack"):
        packed_forward(model, batch, verify=False)


@pytest.mark.parametrize(
    "named,config",
    [
        ("PVeRA", lambda tmp: peft.PveraConfig(r=4, target_modules=["q_proj"], task_type="CAUSAL_LM")),
        ("MonteCLoRA", _lora(monteclora_config=_lora_sub("MontecloraConfig"))),
        ("VeLoRA", _lora(velora_config=_lora_sub("VeloraConfig", num_groups=4))),  # init_type batch_average
    ],
)
def test_methods_that_sample_or_average_over_the_call_are_refused_while_training(case, tmp_path, named, config):
    """Exact in the mode their EXACT case runs; in training mode (PVeRA and MonteCLoRA sample,
    VeLoRA's default init averages over the call) refused by name."""
    _, batch, _ = case
    model = _build(named, Case(config), tmp_path)
    with pytest.raises(UnsupportedModelError, match=rf"{named} \(adapter 'default'"):
        packed_forward(model, batch, verify=False)
    model.eval()
    with torch.no_grad():
        packed_forward(model, batch, verify=False)  # the control: eval mode runs


def render_peft_table() -> str:
    """docs/models.md's PEFT section: every method type and LoRA variant, exact or refused with its reason."""
    rows = ["| PEFT method | on tree rows | why |", "|---|---|---|"]
    for kind, m in sorted(PEFT_METHODS.items()):
        rows.append(f"| `{kind}` | {m.status} | {m.why} |")
    for name, m in sorted(LORA_VARIANTS.items()):
        rows.append(f"| LoRA variant `{name}` | {m.status} | {m.why} |")
    return "\n".join([BEGIN, *rows, END])


def test_docs_peft_table_is_the_checks_table():
    text = DOCS.read_text()
    section = text[text.index(BEGIN) : text.index(END) + len(END)]
    assert section == render_peft_table(), (
        "docs/models.md's PEFT table is stale: "
        "python -c 'import tests.trainer.test_peft_methods as t; print(t.render_peft_table())'"
    )
