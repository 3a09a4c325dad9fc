"""The family sweep: every HF family either passes the oracle or is refused by name before any compute.

Rows come from ``benchmarks/model_support.py`` (:data:`FAMILIES`, tiny random fp32 configs,
every parameter perturbed by seeded noise so that no bias, norm or learned mask sits at its
init value: a term dropped while its parameter is 0 at init would change nothing there).
A ``pass`` row: packed logprobs within 1e-5 and gradients within 1e-4 relative of each
sequence alone, on ``sdpa`` and the ``flash`` reference (naive varlen kernel), through
``output="hidden"`` with the model's own head (:func:`output_head`, the chunked head) on
``sdpa``, and the ``flex`` forward (uncompiled; FlexAttention has no CPU backward). A refused row raises
:class:`UnsupportedModelError` matching its reason, and the model is left untouched.
Training mode: gradient checkpointing (reentrant and not) on both backends with a CPU
backward, for a representative subset here (:data:`TRAIN_SUBSET`) and for every row by
``python benchmarks/model_support.py --train``, whose record docs/models.md shows; the
config's default dropout is refused by name in training mode (the table's column, checked).
Rows marked ``lands_with`` (recurrent mixers, sinks, chunked attention, GLM-MoE-DSA) are
refused with their reason until that work lands, after which the check accepts them and
they must pass the same oracle. After every ``packed_forward`` the same model runs
unpacked, as it is (packed_forward leaves it as it found it), and gives the reference again.
"""

from __future__ import annotations

import re

import pytest
import torch

from treepack.proto.errors import UnsupportedModelError
from treepack.trainer import check_model, materialize, naive_varlen_attention
from treepack.trainer.hf import output_head, packed_forward
from treepack.trainer.losses import naive_sft_loss, sft_loss

from helpers.families import model_support
from helpers.tolerance import assert_close
from helpers.trainer_cases import plan_of, trainable_flags

ms = model_support()

LOGPROB_TOL = 1e-5
GRAD_RTOL = 1e-4


@pytest.fixture(scope="module")
def case():
    c = ms.small_case()  # small: the sweep runs ~50 models on 2 shared cores
    plan = plan_of(c)
    batch = materialize(plan, c["sequences"], trainable=c["trainable"], groups=c["groups"])
    return dict(case=c, batch=batch, flags=trainable_flags(c))


def _reference(model, c):
    """Per-sequence logprobs (NaN off the trainable targets), SFT loss and gradients, each sequence alone."""
    out = []
    for lp, f in zip(ms.unpacked_logprobs(model, c["case"]["sequences"]), c["flags"]):
        full = torch.cat([lp.new_full((1,), float("nan")), lp])
        keep = f.clone()
        keep[0] = False
        out.append(torch.where(keep, full, torch.full_like(full, float("nan"))))
    loss = naive_sft_loss(
        [torch.nan_to_num(x) for x in out], c["flags"], groups=c["case"]["groups"], normalization="sequence"
    )
    loss.backward()
    return [x.detach() for x in out], loss.detach(), _grads(model)


def _grads(model):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def _packed(model, c, backend, output="logits"):
    batch = c["batch"]
    out = packed_forward(
        model, batch, backend=backend, varlen_fn=naive_varlen_attention, output=output, verify=False
    )  # the sweep is its own oracle
    lp = (
        batch.target_logprobs(out) if output == "logits" else batch.target_logprobs_from_hidden(out, output_head(model))
    )
    loss = sft_loss(lp, batch, normalization="sequence")
    loss.backward()
    return [x.detach() for x in batch.unpack_logprobs(lp)], loss.detach(), _grads(model)


def _unpacked_again(model, c, ref_lp):
    """The same model, after packed_forward, still runs unpacked and gives the reference."""
    with torch.no_grad():
        again = ms.unpacked_logprobs(model, c["case"]["sequences"][:3])
    want = [x[1:] for x in ref_lp[:3]]
    assert_close(
        "unpacked after packed_forward",
        want,
        [torch.where(torch.isnan(w), w, a) for w, a in zip(want, again)],
        atol=1e-6,
    )


def _expect_refusal(row) -> bool:
    if row.refused is None:
        return False
    if row.lands_with is None:
        return True
    # Rows whose support lands elsewhere: refused until then, exact (and checked so) after.
    return bool(check_model(ms.build_family(row), raise_error=False).refusals)


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(r, id=r.model_type + ("-" + r.name.split(", ")[1].replace(" ", "_") if ", " in r.name else ""))
        for r in ms.FAMILIES
    ],
)
def test_family(case, row):
    model = ms.build_family(row)
    if _expect_refusal(row):
        with pytest.raises(UnsupportedModelError) as e:
            packed_forward(model, case["batch"])
        reasons = " / ".join(r[2] for r in e.value.refusals)
        assert re.search(row.refused, reasons), reasons
        assert e.value.kind == "unsupported_model" and str(e.value.path).startswith("$.model")
        assert model.config._attn_implementation == "eager", "refused after switching the model"
        with torch.no_grad():
            ms.unpacked_logprobs(model, case["case"]["sequences"][:1])  # untouched, runs unpacked
        return
    ms.perturb(model)
    ref_lp, ref_loss, ref_grads = _reference(model, case)
    assert len(ref_grads) > 0 and abs(float(ref_loss)) > 1e-3
    # output="hidden" + output_head: the chunked head on the decoder stack's hidden states.
    for backend, output in (("sdpa", "logits"), ("flash", "logits"), ("sdpa", "hidden")):
        lp, loss, grads = _packed(model, case, backend, output)
        backend = backend if output == "logits" else "hidden + output_head"
        assert_close(f"{backend} logprobs", ref_lp, lp, atol=LOGPROB_TOL)
        assert torch.allclose(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-7), (
            backend,
            float(loss),
            float(ref_loss),
        )
        # 1e-4 relative per parameter, with a floor at fp32 rounding of the largest gradient
        # (a parameter whose gradient is 1e-5 of the others cannot be held to 1e-4 of itself).
        floor = 1e-7 * max(float(g.abs().max()) for g in ref_grads.values())
        assert_close(f"{backend} grad", ref_grads, grads, atol=floor, ratio=GRAD_RTOL, nonzero_ref=True)
        _unpacked_again(model, case, ref_lp)
    if not row.flex:
        with pytest.raises(UnsupportedModelError, match="BlockMask"):
            packed_forward(model, case["batch"], backend="flex", compile=False)
        return
    with torch.no_grad():
        logits = packed_forward(model, case["batch"], backend="flex", compile=False, verify=False)
    assert_close("flex logprobs", ref_lp, case["batch"].unpack_logprobs(logits), atol=LOGPROB_TOL)
    _unpacked_again(model, case, ref_lp)


def test_the_table_covers_every_mechanism():
    assert len(ms.FAMILIES) >= 30 and len({r.name for r in ms.FAMILIES}) == len(ms.FAMILIES)
    passing = [r for r in ms.FAMILIES if r.refused is None]
    assert len(passing) >= 25
    mechanisms = " ".join(r.mechanism for r in ms.FAMILIES)
    for word in (
        "MoE",
        "sliding",
        "sinks",
        "chunked",
        "soft-cap",
        "logit_scale",
        "logits_scaling",
        "MLA",
        "DSA",
        "hybrid",
        "length-dependent RoPE",
        "auxiliary loss",
    ):
        assert word in mechanisms, word


class _PlantedLayer(torch.nn.Module):
    """An unknown recurrent layer around an MLP: h_t = a * h_{t-1} + x_t over the whole row (no telltale names)."""

    def __init__(self, mlp: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.decay = torch.nn.Parameter(torch.full((hidden,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = torch.zeros_like(x[:, 0]), []
        for t in range(x.shape[1]):
            h = self.decay * h + x[:, t]
            out.append(h)
        return self.mlp(torch.stack(out, 1))


def test_negative_control_planted_recurrent_layer_is_refused(case):
    model = ms.build_family(ms.FAMILIES[2])  # Qwen3
    layer = model.model.layers[1]
    layer.mlp = _PlantedLayer(layer.mlp, model.config.hidden_size)
    with pytest.raises(
        UnsupportedModelError,
        match=r"model\.layers\.1\.mlp \(_PlantedLayer\): forward defined outside torch / transformers",
    ):
        packed_forward(model, case["batch"])
    with torch.no_grad():  # the planted layer does mix tokens: packed and unpacked would differ
        x = torch.randn(1, 5, model.config.hidden_size)
        assert not torch.allclose(layer.mlp(x)[:, 3:], layer.mlp(x[:, 3:]))


def test_subclass_overriding_attention_forward_is_refused(case):
    from transformers.models.qwen3 import modeling_qwen3 as q

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        return q.Qwen3Attention.forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)

    model = ms.build_family(ms.FAMILIES[2])
    inherited = type("MyAttention", (q.Qwen3Attention,), {})  # same forward: runs exactly
    model.model.layers[0].self_attn.__class__ = inherited
    check_model(model)
    overridden = type("MyAttention", (q.Qwen3Attention,), {"forward": forward, "__module__": __name__})
    model.model.layers[0].self_attn.__class__ = overridden
    with pytest.raises(
        UnsupportedModelError,
        match=(
            r"model\.layers\.0\.self_attn \(MyAttention\): "
            r"(attention forward overridden|attention that does not dispatch)"
        ),
    ):
        packed_forward(model, case["batch"])


def test_subclass_of_a_patched_layer_that_overrides_forward_is_refused(case):
    """A renamed subclass that inherits the stock forward is run exactly (tests/trainer/test_mixers_gdn.py);
    one whose forward is its own may compute anything, so it is refused by name."""
    from transformers.models.qwen3_next import modeling_qwen3_next as q

    def forward(self, hidden_states, *args, **kwargs):
        return q.Qwen3NextGatedDeltaNet.forward(self, hidden_states * 1.0, *args, **kwargs)

    model = ms.build_family(next(r for r in ms.FAMILIES if r.model_type == "qwen3_next"))
    renamed = type("MyGatedDeltaNet", (q.Qwen3NextGatedDeltaNet,), {"forward": forward})
    path = next(n for n, m in model.named_modules() if type(m) is q.Qwen3NextGatedDeltaNet)
    model.get_submodule(path).__class__ = renamed
    with pytest.raises(
        UnsupportedModelError, match=rf"{re.escape(path)} \(MyGatedDeltaNet\): subclass of Qwen3NextGatedDeltaNet"
    ):
        packed_forward(model, case["batch"])


@pytest.mark.parametrize("model_type", ["qwen3_next", "bamba", "jamba", "lfm2", "kimi_linear"])
def test_patch_layers_false_is_refused_for_hybrids(case, model_type):
    """Kinds found by exact class (GDN) and by structure (Mamba2, Mamba, short conv, KDA) alike:
    without their tree forwards the stock mixer would scan the whole row."""
    model = ms.build_family(next(r for r in ms.FAMILIES if r.model_type == model_type))
    with pytest.raises(UnsupportedModelError, match=r"patch_layers=False"):
        packed_forward(model, case["batch"], patch_layers=False)


def test_router_logits_requested_per_call_is_refused(case):
    model = ms.build_family(next(r for r in ms.FAMILIES if r.model_type == "mixtral"))
    with pytest.raises(UnsupportedModelError, match=r"output_router_logits=False"):
        packed_forward(model, case["batch"], output_router_logits=True)


@pytest.mark.parametrize(
    "model_type,attr", [("cohere", "logit_scale"), ("granite", "logits_scaling"), ("gemma2", "final_logit_softcapping")]
)
def test_hidden_output_with_logit_transforms_needs_a_head_that_applies_them(case, model_type, attr):
    """output='hidden' is allowed because output_head applies the transforms; a caller without one is refused."""
    model = ms.build_family(next(r for r in ms.FAMILIES if r.model_type == model_type and r.refused is None))
    check_model(model, output="hidden", hidden_applies_logit_transforms=True)
    with pytest.raises(UnsupportedModelError, match=rf"config\.{attr}"):
        check_model(model, output="hidden", hidden_applies_logit_transforms=False)
    check_model(model, output="logits", hidden_applies_logit_transforms=False)


def test_training_with_attention_dropout_is_refused():
    model = ms.build_family(ms.FAMILIES[0])
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    model.train()
    with pytest.raises(UnsupportedModelError, match=r"attention dropout 0.1 while training"):
        check_model(model)
    model.eval()
    check_model(model)


def test_docs_table_matches_the_sweep():
    text = ms.MODELS_DOC.read_text()
    statuses = {row.name: ms.status_of(row) for row in ms.FAMILIES}
    assert ms.doc_section(text) == ms.render_table(statuses), (
        "docs/models.md's model-support table is stale: run `python benchmarks/model_support.py --write-docs`"
    )
    # The dropout column is not vacuous: defaults with dropout are refused by name, others run.
    dropout = [d for s, _, d in statuses.values() if s == "exact"]
    assert "none" in dropout and sum(d.startswith("refused: ") for d in dropout) >= 2, dropout  # GPT-2, GPTBigCode


# Rows whose training setups (checkpointing reentrant and not, sdpa and flash, perturbed
# parameters) the main run checks live: a decoder layer that calls attention without
# **kwargs (StableLM), a mask passed positionally into checkpointing (GPT-2: reentrant
# replays get a detached alias of it), sliding/global layers with soft-caps (Gemma 2), a
# patched recurrent mixer replayed (Qwen3.5's Gated DeltaNet) and a patched sparse indexer
# with MLA and MoE (DeepSeek-V3.2). The other rows: ``model_support.py --train``.
TRAIN_SUBSET = ("StableLM", "GPT-2", "Gemma 2", "Qwen3.5", "DeepSeek-V3.2")


@pytest.mark.parametrize("name", TRAIN_SUBSET)
def test_training_setups_exact(name):
    row = next(r for r in ms.FAMILIES if r.name == name)
    errs = ms.train_oracle(ms.perturb(ms.build_family(row)))
    assert sorted(errs) == sorted(f"{b}, {'reentrant' if r else 'non-reentrant'}" for b, r in ms.TRAIN_SETUPS)
    for setup, e in errs.items():
        assert ms.within(e), (
            f"{name} {setup}: logprob error {e[0]:.3g} (<= {ms.LOGPROB_TOL}), "
            f"gradient error {e[1]:.3g} (<= {ms.GRAD_RTOL} relative)"
        )
    recorded = ms.recorded_training()["rows"].get(name)
    assert recorded is not None and all(ms.within(tuple(e)) for e in recorded.values()), (
        f"{name}: the recorded sweep disagrees: {recorded}"
    )


def test_the_training_record_covers_every_exact_row():
    """The docs' checkpointing column comes from the recorded ``--train`` run: it must be of
    this transformers and torch, cover exactly the rows check_model accepts, every setup each."""
    import transformers

    rec = ms.recorded_training()
    assert (rec.get("transformers"), rec.get("torch")) == (transformers.__version__, torch.__version__.split("+")[0]), (
        "rerun `python benchmarks/model_support.py --train --write-docs`"
    )
    exact = {r.name for r in ms.FAMILIES if r.refused is None or r.lands_with is not None and not _expect_refusal(r)}
    assert set(rec["rows"]) == exact
    setups = {f"{b}, {'reentrant' if r else 'non-reentrant'}" for b, r in ms.TRAIN_SETUPS}
    assert all(set(v) == setups for v in rec["rows"].values())


def test_negative_control_a_dropped_model_bias_fails_the_perturbed_oracle(monkeypatch):
    """Doge hands its attention function a learned dynamic mask. With the run-time refusal of a
    mask treepack did not build switched off, tree attention silently drops it. At init (``A``
    is 0: the mask is constant per row) the forward logprobs still agree, which is how a
    forward check at init called Doge exact; at perturbed parameters the logprobs differ and
    ``A`` gets no gradient at all (an infinite error): the oracle of the checks above fails."""
    from treepack.trainer.hf import attention

    monkeypatch.setattr(attention, "_is_tree_mask", lambda mask, tree: True)
    row = next(r for r in ms.FAMILIES if r.model_type == "doge")
    at_init = ms.train_oracle(ms.build_family(row), setups=(("sdpa", False),))["sdpa, non-reentrant"]
    lp, grad = ms.train_oracle(ms.perturb(ms.build_family(row)), setups=(("sdpa", False),))["sdpa, non-reentrant"]
    assert at_init[0] <= ms.LOGPROB_TOL, at_init
    assert lp > 10 * ms.LOGPROB_TOL and grad > 100 * ms.GRAD_RTOL, (lp, grad)


def test_reentrant_replay_passes_a_detached_alias_of_the_tree_mask():
    """Reentrant checkpointing detaches the layer's tensor inputs: the alias is accepted (same
    storage), any other mask, even an equal copy, is refused as the model's own."""
    from treepack.trainer.hf.attention import _is_tree_mask

    tree = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    assert _is_tree_mask(tree, tree) and _is_tree_mask(tree.detach(), tree)
    assert (
        not _is_tree_mask(tree.clone(), tree)
        and not _is_tree_mask(tree[:1], tree)
        and not _is_tree_mask(tree.float(), tree)
    )


# The automatic sweep's skips, each acknowledged with its reason: HF builds no tiny model of
# these from the shrunken default config (``ms.sweep_one``). A new skip (or one for another
# reason) fails until it is added here; an architecture listed here that now builds fails
# until it is removed (then it is swept). transformers as pinned by ``make test``.
SWEEP_SKIPS: dict[str, str] = {
    **dict.fromkeys(
        (
            "blt",
            "gemma3",
            "git",
            "got_ocr2",
            "inkling2_loop_text",
            "inkling2_text",
            "longcat_flash",
            "moss_transcribe_diarize",
            "phi4_multimodal",
            "prophetnet",
            "recurrent_gemma",
            "roc_bert",
            "xlm",
        ),
        r"unbuildable: ValueError: \d+ parameters after shrinking \(over 3000000\)",
    ),
    **dict.fromkeys(
        ("dots3_note", "dots3_note_text"),
        r"unbuildable: AmbiguousGlobalPerLayerAttributeError: 'num_attention_heads' is a per-layer attribute",
    ),
    **dict.fromkeys(
        ("gemma4", "gemma4_text", "gemma4_unified", "gemma4_unified_assistant", "gemma4_unified_text"),
        r"unbuildable: AmbiguousGlobalPerLayerAttributeError: 'head_dim' is a per-layer attribute",
    ),
    **dict.fromkeys(
        ("hunyuan_v1_moe", "ministral"),
        r"unbuildable: TypeError: unsupported operand type\(s\) for \*\* or pow\(\): 'NoneType' and 'float'",
    ),
    **dict.fromkeys(
        ("qwen4_exp", "qwen4_exp_text"),
        r"unbuildable: TypeError: unsupported operand type\(s\) for //: 'NoneType' and 'NoneType'",
    ),
    **dict.fromkeys(
        ("musicgen", "musicgen_melody"),
        r"unbuildable: AttributeError: 'Musicgen\w*Config' object has no attribute 'dropout'",
    ),
    "cohere_compass_text": r"unbuildable: KeyError: 'full_attention'",
    "dbrx": r"unbuildable: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta'",
    "dots1": r"unbuildable: TypeError: empty\(\) takes 1 positional argument but 3 were given",
    "gemma3n": r"unbuildable: ImportError",
    "gemma3n_text": r"unbuildable: ValueError: The set of layer types producing a cache is different",
    "gemma4_assistant": (
        r"unbuildable: StrictDataclassClassValidationError: "
        r"Class validation error for validator 'validate_architecture'"
    ),
    "lfm2_moe": r"unbuildable: TypeError: 'NoneType' object is not subscriptable",
    "nemotron": r"unbuildable: TypeError: unsupported operand type\(s\) for //: 'int' and 'NoneType'",
    "reformer": (
        r"unbuildable: AssertionError: If you want to use `ReformerModelWithLMHead` make sure that `is_decoder=True`"
    ),
    "zamba": r"unbuildable: ValueError: There is an issue with your definition of `tie_weights_keys`",
}


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ms.causal_lm_types())
def test_automatic_sweep_none_silently_wrong(model_type):
    """Every causal-LM architecture of the installed transformers: refused, or exact (forward oracle, sdpa).

    Only building the stock model and running it alone may end in a skip, and only as
    acknowledged in :data:`SWEEP_SKIPS`; an error of treepack's own code fails.
    """
    status, detail = ms.sweep_one(model_type)
    if any(row.model_type == model_type and row.refused is None for row in ms.FAMILIES):
        assert status == "pass", f"{model_type} is exact in the docs' table, but the sweep says {status} ({detail})"
    if status in ("unbuildable", "stock_fails"):
        said = f"{status}: {detail}"
        assert model_type in SWEEP_SKIPS, (
            f"{model_type} is newly skipped ({said}): make it build, or acknowledge it in SWEEP_SKIPS"
        )
        assert re.match(SWEEP_SKIPS[model_type], said), (
            f"{model_type} skips for another reason: {said!r} (acknowledged: {SWEEP_SKIPS[model_type]!r})"
        )
        pytest.skip(f"{ms.SWEEP_STATUSES[status]} (acknowledged in SWEEP_SKIPS; the stock model's error: {detail})")
    assert model_type not in SWEEP_SKIPS, (
        f"{model_type} is acknowledged as skipped but now runs ({status}): remove it from SWEEP_SKIPS"
    )
    assert status in ("pass", "refused"), f"{model_type}: {status} ({detail})"


def test_the_acknowledged_skips_are_architectures_of_this_transformers():
    """A stale name in SWEEP_SKIPS (an architecture transformers dropped) is not a pin."""
    assert sorted(set(SWEEP_SKIPS) - set(ms.causal_lm_types())) == []
    assert len(SWEEP_SKIPS) == 36, len(SWEEP_SKIPS)  # the skip count, pinned: 51 before the sweep's configs were fixed


def test_a_treepack_error_in_the_sweep_fails_instead_of_skipping(monkeypatch):
    """Negative control: a bug planted in the layer patches propagates out of sweep_one."""

    def planted(model):
        raise RuntimeError("planted bug in the layer patches")

    monkeypatch.setattr(ms, "_with_patches", planted)
    with pytest.raises(RuntimeError, match="planted bug"):
        ms.sweep_one("qwen3_next")
    monkeypatch.setattr(ms, "build_causal_lm", lambda *a, **k: (_ for _ in ()).throw(ValueError("no tiny config")))
    assert ms.sweep_one("qwen3_next") == ("unbuildable", "ValueError: no tiny config")
