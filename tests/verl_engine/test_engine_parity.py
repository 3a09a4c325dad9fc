"""TreepackFSDPEngine against stock verl 0.9.1 (FSDPEngineWithLMHead), FSDP2 on one CPU gloo rank.

Both engines load the same tiny Qwen2. ``infer_batch``: the full-sequence jagged log-probs
and entropies, read back at the response positions exactly as verl's trainer does
(``no_padding_2_padding``). ``train_batch`` (one mini-batch update, as the worker's
``train_mini_batch`` runs it): with SGD at lr 1 and no clipping, the parameter update
equals the gradient of verl's own PPO loss; it must match for every ``loss_agg_mode``,
dynamic batch size on/off, remove-padding on/off, gradient checkpointing on/off.
"""

from __future__ import annotations

import pytest
from engines import PARITY, build, flags, grpo_batch, loss_fn, params, restore
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.utils.padding import no_padding_2_padding

from treepack.trainer.verl import TreepackFSDPEngine

from helpers.tolerance import assert_close, assert_not_close


@pytest.fixture(scope="module", params=[False, True], ids=["no-ckpt", "grad-ckpt"])
def engines(request):
    return (
        build(FSDPEngineWithLMHead, grad_ckpt=request.param),
        build(TreepackFSDPEngine, grad_ckpt=request.param),
        request.param,
    )


def _infer(eng, td):
    with eng.eval_mode():
        out = eng.infer_batch(td)
    mo = out["model_output"]
    return no_padding_2_padding(mo["log_probs"], td), no_padding_2_padding(mo["entropy"], td), out["metrics"]


def _update(eng, td, mode):
    before = params(eng)
    with eng.train_mode():
        out = eng.train_batch(td, loss_function=loss_fn(mode))
    after = params(eng)
    restore(eng, before)
    return {k: before[k] - after[k] for k in before}, out["metrics"]


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-bsz", "dynamic-bsz"])
def test_infer_batch_matches_stock(engines, dynamic, rmpad):
    stock, tree, ckpt = engines
    td = lambda: flags(
        grpo_batch(seed=1), dynamic=dynamic, rmpad=rmpad, temperature=0.7, calculate_entropy=True, compute_loss=False
    )  # noqa: E731
    lp_ref, ent_ref, _ = _infer(stock, td())
    lp, ent, metrics = _infer(tree, td())
    mask = (
        td()["response_mask"].to_padded_tensor(0).bool()
        if td()["response_mask"].is_nested
        else td()["response_mask"].bool()
    )
    assert_close("log_probs", lp_ref[mask], lp[mask], atol=1e-5, nonzero_ref=True)
    assert_close("entropy", ent_ref[mask], ent[mask], atol=1e-5, nonzero_ref=True)
    saved = metrics["treepack/saved_fraction"].values
    assert saved and min(saved) > 0, saved  # every micro-batch holds whole groups: shared prompts
    PARITY.append(
        (
            f"infer ckpt={ckpt} dynamic={dynamic} rmpad={rmpad}",
            (lp - lp_ref)[mask].abs().max().item(),
            (ent - ent_ref)[mask].abs().max().item(),
            float("nan"),
        )
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-bsz", "dynamic-bsz"])
def test_train_batch_update_matches_stock(engines, mode, dynamic):
    stock, tree, ckpt = engines
    td = lambda: flags(grpo_batch(seed=2), dynamic=dynamic, rmpad=True, calculate_entropy=False, global_batch_size=8)  # noqa: E731
    ref, _ = _update(stock, td(), mode)
    got, metrics = _update(tree, td(), mode)
    assert_close(f"update ({mode})", ref, got, ratio=1e-4, nonzero_ref=True)
    assert metrics["treepack/rows"].values and metrics["treepack/plan_ms"].values
    err = max((ref[k] - got[k]).abs().max().item() for k in ref)
    PARITY.append((f"update ckpt={ckpt} dynamic={dynamic} {mode}", float("nan"), float("nan"), err))


def test_negative_control_other_batch_differs(engines):
    """The oracle can fail: the update of another batch (other responses) differs."""
    stock, tree, _ = engines
    ref, _ = _update(stock, flags(grpo_batch(seed=2), dynamic=False, rmpad=True, global_batch_size=8), "token-mean")
    got, _ = _update(tree, flags(grpo_batch(seed=3), dynamic=False, rmpad=True, global_batch_size=8), "token-mean")
    assert_not_close("update of another batch", ref, got, atol=1e-4)
    # The loss_agg_mode parametrization exercises different losses (seq-mean-token-sum
    # weights the sequences differently from token-mean on this batch).
    other, _ = _update(
        stock, flags(grpo_batch(seed=2), dynamic=False, rmpad=True, global_batch_size=8), "seq-mean-token-sum"
    )
    assert_not_close("token-mean vs seq-mean-token-sum update", ref, other, atol=1e-4)


def test_recorded_batches_carry_the_run_tag(engines, tmp_path, monkeypatch):
    """What the engine plans is recorded with its tag (``TREEPACK_VERL_TAG``): a what-if then
    samples this run's batches by tag; an empty tag records them untagged (the control)."""
    from treepack.client import Packer
    from treepack.trainer.verl import VerlPacking

    _, tree, _ = engines
    monkeypatch.setenv("TREEPACK_VERL_TAG", "run-7")
    assert VerlPacking.from_env().tag == "run-7"
    for tag, want in (("run-7", {"run-7"}), ("", {""})):
        with Packer(history_path=str(tmp_path / f"h{tag}.sqlite3")) as packer:
            monkeypatch.setattr(tree, "packing", VerlPacking(planner=packer, tag=tag))
            td = flags(grpo_batch(seed=1), dynamic=False, rmpad=True, calculate_entropy=True, compute_loss=False)
            _infer(tree, td)
            history = packer.history()
        assert history["batches"] >= 1 and set(history["tags"]) == want, history
