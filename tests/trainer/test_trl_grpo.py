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


def test_learned_positions_stock_left_padding_differs_from_alone_treepack_does_not():
    """The docs' parity caveat, measured: stock TRL calls the policy on left-padded prompt rows
    without position_ids; for learned absolute positions (GPT-2) a shorter prompt's tokens then
    sit at shifted positions, while treepack scores each sequence at its own positions. RoPE
    (Qwen3) is the control: the shift changes nothing but rounding there."""
    import numpy as np
    import torch
    import transformers as tf

    from treepack.service.planner import plan_batch
    from treepack.trainer import materialize
    from treepack.trainer.hf import packed_forward

    from helpers.tiny_trl import tiny_model

    torch.manual_seed(0)
    gpt2 = tf.GPT2LMHeadModel(
        tf.GPT2Config(vocab_size=43, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
                      eos_token_id=1, pad_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ).eval()  # fmt: skip
    rng = np.random.default_rng(0)
    seqs, starts = [], []
    for n in (5, 12, 20):  # prompts of different lengths, four completions each
        p = rng.integers(3, 43, n)
        for _ in range(4):
            seqs.append(np.concatenate([p, rng.integers(3, 43, 6)]))
            starts.append(n)
    T = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, T - len(s) :], mask[i, T - len(s) :] = torch.as_tensor(s), 1
    batch = materialize(plan_batch(seqs, seq_len=128, min_shared_len=4, trainable=starts), seqs, trainable=starts)

    def errors(model):
        with torch.no_grad():
            stock = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)  # TRL's call
            packed = batch.unpack_logprobs(batch.target_logprobs(packed_forward(model, batch)))
            e_stock = e_packed = 0.0
            for i, s in enumerate(seqs):
                x = torch.as_tensor(s)
                alone = torch.log_softmax(model(input_ids=x[None]).logits[0].float(), -1)[:-1].gather(1, x[1:, None])
                left = stock[i, T - len(s) : -1].gather(1, x[1:, None])
                done = slice(starts[i] - 1, None)  # the completion's targets
                e_stock = max(e_stock, float((left - alone)[done].abs().max()))
                e_packed = max(e_packed, float((packed[i][starts[i] :] - alone[done, 0]).abs().max()))
        return e_stock, e_packed

    e_stock, e_packed = errors(gpt2)
    assert e_stock > 0.1 and e_packed < 1e-5, (e_stock, e_packed)  # docs/trl.md: 0.23 and 4.8e-7
    e_stock, e_packed = errors(tiny_model().eval())
    assert e_stock < 1e-5 and e_packed < 1e-5, (e_stock, e_packed)


def test_alora_matches_stock(tmp_path, monkeypatch):
    """aLoRA through TRL: stock TRL finds the invocation per (left-padded) row, which is per
    sequence; treepack activates each sequence from its own match and plans with keys that keep
    sharers of a position on the same side of their activation. The invocation ("w34") occurs in
    both prompts of the first step and in some of their completions, so sequences of one prompt
    disagree after the prompt's match (the adapter trains from the first step). Negative controls:
    planned without the keys, the step is refused (naming two sequences) before the model runs;
    with PEFT's own per-row offsets, the loss and grad_norm differ from stock."""
    import numpy as np
    from peft import LoraConfig

    from treepack.trainer.data.payloads import PayloadMismatchError
    from treepack.trainer.trl import step

    cfg = dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
        alora_invocation_tokens=[tiny_tokenizer().convert_tokens_to_ids("w34")], task_type="CAUSAL_LM",
    )  # fmt: skip

    def run(name, cls, steps=2):
        return run_grpo(cls, workdir=str(tmp_path / name), steps=steps, beta=0.0, peft_config=LoraConfig(**cfg))

    stock, packed = run("stock", trl.GRPOTrainer), run("packed", TreepackGRPOTrainer)
    assert packed["completions"] == stock["completions"]
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], **TOL)
    assert packed["loss"] == pytest.approx(stock["loss"], **TOL)
    assert min(stock["grad_norm"]) > 0.01, stock["grad_norm"]  # the adapter is on somewhere at every step
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.1, saved  # prompts were still shared

    with monkeypatch.context() as m:  # the keys matter: without them sharers disagree
        m.setattr(step, "alora_keys", lambda seqs, inv: [np.zeros(len(x), dtype=np.uint64) for x in seqs])
        with pytest.raises(PayloadMismatchError, match=r"aLoRA activation: sequences \d+ and \d+ share row position"):
            run("unkeyed", TreepackGRPOTrainer, steps=1)
    with monkeypatch.context() as m:  # the per-sequence activation matters
        m.setattr(step, "alora_inputs", lambda model, batch: {})
        per_row = run("per_row", TreepackGRPOTrainer, steps=1)
    assert per_row["completions"] == stock["completions"][: len(per_row["completions"])]
    assert per_row["grad_norm"][0] != pytest.approx(stock["grad_norm"][0], rel=1e-3), (per_row, stock["grad_norm"])
