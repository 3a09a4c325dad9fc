"""``trl.SFTTrainer`` and ``TreepackSFTTrainer`` side by side: 4 completions per prompt share it."""

from __future__ import annotations

import pytest

from helpers.extras import require

trl = require("trl")

from treepack.proto.errors import RequestError  # noqa: E402
from treepack.trainer.trl import TreepackSFTTrainer  # noqa: E402

from helpers.tiny_trl import run_sft  # noqa: E402


@pytest.mark.parametrize("loss_type", ["nll", "dft"])
def test_sft_matches_stock(tmp_path, loss_type):
    stock = run_sft(trl.SFTTrainer, workdir=str(tmp_path / "s"), loss_type=loss_type)
    packed = run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "p"), loss_type=loss_type)
    assert len(stock["loss"]) == 3
    assert packed["loss"] == pytest.approx(stock["loss"], abs=1e-5, rel=1e-4)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], abs=1e-5, rel=1e-4)
    ent = lambda r: [h["entropy"] for h in r["logs"] if "entropy" in h]  # noqa: E731
    assert ent(packed) == pytest.approx(ent(stock), abs=1e-5, rel=1e-4)
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.15, saved  # the sampler mixes prompts: some rows of each batch share one


def test_sft_refuses_padding_free(tmp_path):
    with pytest.raises(RequestError, match="padding_free"):
        run_sft(TreepackSFTTrainer, workdir=str(tmp_path / "p"), padding_free=True, max_length=None, steps=1)


def test_sft_alora_matches_stock(tmp_path, monkeypatch):
    """aLoRA through TRL's SFT: stock TRL finds the invocation per (right-padded) row, which is
    per sequence; treepack activates each sequence from its own match (planned with keys that keep
    sharers of a position on the same side of their activation). The invocation ("w34") occurs
    in prompts and completions. Negative controls: planned without the keys, refused naming two
    sequences; with PEFT's own per-row offsets, grad_norm differs from stock."""
    import numpy as np
    from peft import LoraConfig

    from treepack.trainer.data.payloads import PayloadMismatchError
    from treepack.trainer.trl import step

    from helpers.tiny_trl import tiny_tokenizer

    cfg = dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False,
        alora_invocation_tokens=[tiny_tokenizer().convert_tokens_to_ids("w34")], task_type="CAUSAL_LM",
    )  # fmt: skip

    def run(name, cls, steps=2):
        return run_sft(cls, workdir=str(tmp_path / name), steps=steps, peft_config=LoraConfig(**cfg))

    stock, packed = run("stock", trl.SFTTrainer), run("packed", TreepackSFTTrainer)
    assert packed["loss"] == pytest.approx(stock["loss"], abs=1e-5, rel=1e-4)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], abs=1e-5, rel=1e-4)
    assert min(stock["grad_norm"]) > 0.01, stock["grad_norm"]  # the adapter is on somewhere at every step
    saved = [h["treepack/saved_fraction"] for h in packed["logs"] if "treepack/saved_fraction" in h]
    assert saved and min(saved) > 0.1, saved

    with monkeypatch.context() as m:  # the keys matter: without them sharers disagree
        m.setattr(step, "alora_keys", lambda seqs, inv: [np.zeros(len(x), dtype=np.uint64) for x in seqs])
        with pytest.raises(PayloadMismatchError, match=r"aLoRA activation: sequences \d+ and \d+ share row position"):
            run("unkeyed", TreepackSFTTrainer)
    with monkeypatch.context() as m:  # the per-sequence activation matters
        m.setattr(step, "alora_inputs", lambda model, batch: {})
        per_row = run("per_row", TreepackSFTTrainer, steps=1)
    assert per_row["grad_norm"][0] != pytest.approx(stock["grad_norm"][0], rel=1e-3), (per_row, stock["grad_norm"])
