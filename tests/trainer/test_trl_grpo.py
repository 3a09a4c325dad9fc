"""``trl.GRPOTrainer`` and ``TreepackGRPOTrainer`` trained side by side on a tiny random Qwen3.

Same seed, same data, same in-code reward: per-step loss and grad_norm (and TRL's logged
``kl``, ``clip_ratio/*``, ``entropy``) agree within 1e-5 relative, completions and rewards
are identical (so the random stream and the generation were left alone), on a table of
configurations: every loss type with beta > 0 (reference logprobs), num_iterations=2
(old-policy logprobs), gradient accumulation with steps_per_generation above it, the
entropy quantile, gradient checkpointing and LoRA; the model generates between steps. A
guard checks the plans shared tokens (the comparison is not vacuous).
"""

from __future__ import annotations

import pytest

from helpers.extras import require

trl = require("trl")
require("peft")

from treepack.proto.errors import UnsupportedModelError  # noqa: E402
from treepack.trainer.hf import unwrap_model  # noqa: E402
from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer  # noqa: E402

from helpers.tiny_trl import run_grpo, tiny_tokenizer  # noqa: E402

TOL = dict(rel=1e-5, abs=1e-7)  # abs: a loss of exactly 0 rounds to +-3e-8 in fp32
LOGGED = ("kl", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "entropy")


def _logged(run, key):
    return [h[key] for h in run["logs"] if key in h]


def _side_by_side(tmp_path, steps=3, **config):
    stock = run_grpo(trl.GRPOTrainer, workdir=str(tmp_path / "stock"), steps=steps, **config)
    packed = run_grpo(TreepackGRPOTrainer, workdir=str(tmp_path / "packed"), steps=steps, **config)
    assert len(stock["loss"]) == steps
    assert packed["completions"] == stock["completions"]
    assert packed["rewards"] == stock["rewards"]
    assert packed["loss"] == pytest.approx(stock["loss"], **TOL)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], **TOL)
    for key in LOGGED:
        assert _logged(packed, key) == pytest.approx(_logged(stock, key), rel=1e-5, abs=1e-7), key
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.1 and max(saved) > 0.3, saved  # prompts were shared: not a trivial comparison
    return stock, packed


# The table: every loss type, and the settings where TRL's micro-batches differ from the
# generation batch (accumulation below steps_per_generation, several iterations, the entropy
# quantile), each with its own per-micro-batch normalisation.
TABLE = {
    "grpo": dict(loss_type="grpo", beta=0.05),
    "dapo": dict(loss_type="dapo", beta=0.05),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.05),
    "bnpo": dict(loss_type="bnpo", beta=0.05),
    "cispo": dict(loss_type="cispo", beta=0.05),
    "accum2-spg4-grpo": dict(loss_type="grpo", gradient_accumulation_steps=2, steps_per_generation=4, beta=0.05),
    "accum2-spg4-dapo-entropy0.3": dict(
        loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4, top_entropy_quantile=0.3
    ),
    "accum2-iter2-bnpo": dict(loss_type="bnpo", gradient_accumulation_steps=2, num_iterations=2, beta=0.0),
    "accum2-dr_grpo-entropy0.3": dict(
        loss_type="dr_grpo", gradient_accumulation_steps=2, top_entropy_quantile=0.3, beta=0.05
    ),
}


@pytest.mark.parametrize("name", list(TABLE))
def test_table_matches_stock(tmp_path, name):
    _side_by_side(tmp_path, **TABLE[name])


def test_trainer_refuses_what_packed_forward_refuses_before_the_first_step(tmp_path):
    # A forward hook that mixes positions: check_model's walk alone cannot see it.
    calls = []

    def mixing(module, args, out):
        calls.append(1)
        return out + 0.5 * out.cumsum(1)

    def plant(trainer):
        unwrap_model(trainer.model).model.layers[0].mlp.register_forward_hook(mixing)

    with pytest.raises(UnsupportedModelError, match=r"layers\.0\.mlp.*forward hook .*mixing") as e:
        run_grpo(TreepackGRPOTrainer, workdir=str(tmp_path / "p"), steps=1, before_train=plant)
    assert e.value.kind == "unsupported_model"


def test_old_policy_logprobs_match_stock(tmp_path):
    # num_iterations=2: TRL scores the old policy (a no-grad packed call) and reuses the batch.
    _side_by_side(tmp_path, num_iterations=2, beta=0.0, loss_type="grpo")


def test_gradient_checkpointing_matches_stock(tmp_path):
    _side_by_side(tmp_path, gradient_checkpointing=True, beta=0.05)


def test_lora_matches_stock_and_generates_between_steps(tmp_path):
    tok = tiny_tokenizer()
    outs = []

    def generate(trainer):
        model = trainer.model
        ids = tok(["w1 w2 w3"], return_tensors="pt")
        outs.append(model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=0).tolist())

    for name, cls in (("stock", trl.GRPOTrainer), ("packed", TreepackGRPOTrainer)):
        res = run_grpo(cls, workdir=str(tmp_path / name), lora=True, beta=0.05, between_steps=generate)
        if name == "stock":
            stock = res
    assert len(outs) == 6 and outs[:3] == outs[3:]
    assert res["completions"] == stock["completions"]
    assert res["loss"] == pytest.approx(stock["loss"], **TOL)
    assert res["grad_norm"] == pytest.approx(stock["grad_norm"], **TOL)


def test_packing_config_is_checked_and_seq_len_is_used(tmp_path):
    from treepack.client import Packer

    with pytest.raises(ValueError, match="backend"):
        PackingConfig(backend="nope")
    with pytest.raises(ValueError, match="tag"):
        PackingConfig(tag="x" * 257)
    with Packer(history_path=str(tmp_path / "h.sqlite3")) as packer:
        res = run_grpo(
            TreepackGRPOTrainer,
            workdir=str(tmp_path / "p"),
            steps=1,
            run_name="grpo-tagged-run",
            trainer_kwargs={"packing": PackingConfig(seq_len=128, planner=packer)},
        )
        history = packer.history()
    rows = [h["treepack/rows"] for h in res["logs"] if "treepack/rows" in h]
    assert rows == [1.0]  # 8 sequences of <= 26 tokens, two prompts of 20: one 128-token row
    # What the trainer recorded carries the run's name as its tag: a what-if picks this run by it.
    assert history["batches"] >= 1 and set(history["tags"]) == {"grpo-tagged-run"}, history
    assert history["seq_lens"] == [128]


def test_several_micro_batches_per_generation_match_stock(tmp_path, monkeypatch):
    """steps_per_generation=2: each generation (16 completions) trains over two optimizer steps,
    8 rows each, so the shuffle's order decides what each step sees.

    With TRL's shuffle (``keep_groups=False``) the packed trainer equals stock TRL; with
    ``keep_groups=True`` it equals stock TRL whose shuffle is the group-keeping rule written
    from scratch (:func:`helpers.tiny_trl.group_shuffle_reference`), and the two stock runs
    differ (the order matters here, so the comparison is not vacuous).
    """
    from trl.trainer import grpo_trainer

    from helpers.tiny_trl import group_shuffle_reference

    config = dict(steps=3, steps_per_generation=2, beta=0.05, loss_type="grpo")
    stock = run_grpo(trl.GRPOTrainer, workdir=str(tmp_path / "stock"), **config)
    packed = run_grpo(
        TreepackGRPOTrainer,
        workdir=str(tmp_path / "packed"),
        trainer_kwargs={"packing": PackingConfig(keep_groups=False)},
        **config,
    )
    assert len(stock["loss"]) == 3 and packed["completions"] == stock["completions"]
    assert packed["loss"] == pytest.approx(stock["loss"], **TOL) and packed["grad_norm"] == pytest.approx(
        stock["grad_norm"], **TOL
    )

    grouped = run_grpo(
        TreepackGRPOTrainer,
        workdir=str(tmp_path / "grouped"),
        trainer_kwargs={"packing": PackingConfig(keep_groups=True)},
        **config,
    )
    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", group_shuffle_reference)
    stock_grouped = run_grpo(trl.GRPOTrainer, workdir=str(tmp_path / "stock_grouped"), **config)
    assert grouped["completions"] == stock_grouped["completions"]
    assert grouped["loss"] == pytest.approx(stock_grouped["loss"], **TOL) and grouped["grad_norm"] == pytest.approx(
        stock_grouped["grad_norm"], **TOL
    )
    assert stock_grouped["loss"] != pytest.approx(stock["loss"], **TOL), (
        "the shuffle's order changed nothing: the test cannot see it"
    )
