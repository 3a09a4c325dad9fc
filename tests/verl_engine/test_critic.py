"""The critic on tree rows: TreepackFSDPValueEngine against stock verl 0.9.1 (FSDPEngineWithValueHead).

Both engines load the same tiny Qwen2 value model (``Qwen2ForTokenClassification``, one label;
verl's model type ``value_model``), FSDP2 on one CPU gloo rank. ``infer_batch`` (verl's
``compute_values``): the jagged values, read back at the response positions as verl's trainer
does, equal stock verl's and each sequence run alone. ``train_batch`` (``update_critic``): with
SGD at lr 1 the parameter update is the gradient of verl's own clipped value loss; it must match
stock's for each ``loss_agg_mode``, dynamic batch size on and off, gradient checkpointing on and
off. Negative controls: another batch's update differs, and values from rows under a plain
causal mask (every token sees the whole row before it) differ.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engines import PARITY, build_critic, critic_batch, flags, params, restore, value_loss_fn
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead
from verl.workers.utils.padding import no_padding_2_padding

import treepack.trainer.verl as tverl
from treepack.trainer.verl import TreepackFSDPValueEngine

from helpers.tolerance import assert_close, assert_not_close


@pytest.fixture(scope="module", params=[False, True], ids=["no-ckpt", "grad-ckpt"])
def critics(request):
    stock = build_critic(FSDPEngineWithValueHead, grad_ckpt=request.param)
    tree = build_critic(TreepackFSDPValueEngine, grad_ckpt=request.param)
    assert type(tree.module).__name__.endswith("ForTokenClassification")
    return stock, tree, request.param


def _td(seed=1, dynamic=False, rmpad=True, **kw):
    return flags(critic_batch(seed=seed), dynamic=dynamic, rmpad=rmpad, **kw)


def _values(eng, td):
    """The response positions' values of ``infer_batch``, as verl's trainer reads them ([B, R]), and the mask."""
    with eng.eval_mode():
        out = eng.infer_batch(td)
    m = td["response_mask"]
    mask = (m.to_padded_tensor(0) if m.is_nested else m).bool()
    return no_padding_2_padding(out["model_output"]["values"], td), mask, out["metrics"]


def _alone(eng, td):
    """Each sequence alone through the critic's model: the value before each response token ([B, R])."""
    ids = td["input_ids"]
    offsets, R = ids.offsets(), td["responses"].shape[1]
    out = torch.zeros(len(offsets) - 1, R)
    resp = td["attention_mask"][:, -R:].sum(1) if "attention_mask" in td.keys() else None
    with torch.no_grad(), eng.eval_mode():
        for b in range(len(offsets) - 1):
            s = ids.values()[offsets[b] : offsets[b + 1]]
            n = int(resp[b]) if resp is not None else int(td["responses"].offsets().diff()[b])
            v = eng.module(input_ids=s[None], use_cache=False).logits[0, :, 0]
            out[b, :n] = v[len(s) - n - 1 : len(s) - 1]
    return out


@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-bsz", "dynamic-bsz"])
def test_values_match_stock_and_each_sequence_alone(critics, dynamic, rmpad):
    stock, tree, ckpt = critics
    td = lambda: _td(dynamic=dynamic, rmpad=rmpad, compute_loss=False)  # noqa: E731
    ref, mask, _ = _values(stock, td())
    got, _, metrics = _values(tree, td())
    assert_close("values vs stock", ref[mask], got[mask], atol=1e-5, nonzero_ref=True)
    alone = _alone(tree, td())
    assert_close("values vs each sequence alone", alone[mask], got[mask], atol=1e-5, nonzero_ref=True)
    assert min(metrics["treepack/saved_fraction"].values) > 0
    err = (got - ref)[mask].abs().max().item()
    PARITY.append((f"critic values ckpt={ckpt} dynamic={dynamic} rmpad={rmpad}", err, float("nan"), float("nan")))


def _update(eng, td, mode):
    before = params(eng)
    with eng.train_mode():
        out = eng.train_batch(td, loss_function=value_loss_fn(mode))
    after = params(eng)
    restore(eng, before)
    return {k: before[k] - after[k] for k in before}, out["metrics"]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-bsz", "dynamic-bsz"])
def test_critic_update_matches_stock(critics, mode, dynamic):
    stock, tree, ckpt = critics
    td = lambda: _td(seed=2, dynamic=dynamic, global_batch_size=8)  # noqa: E731
    ref, _ = _update(stock, td(), mode)
    got, metrics = _update(tree, td(), mode)
    assert_close(f"critic update ({mode})", ref, got, ratio=1e-4, nonzero_ref=True)
    assert metrics["treepack/rows"].values
    err = max((ref[k] - got[k]).abs().max().item() for k in ref)
    PARITY.append((f"critic update ckpt={ckpt} dynamic={dynamic} {mode}", float("nan"), float("nan"), err))


def test_negative_controls(critics, monkeypatch):
    """Another batch's update differs; values from rows under a plain causal row mask differ."""
    stock, tree, _ = critics
    ref, _ = _update(stock, _td(seed=2, global_batch_size=8), "token-mean")
    got, _ = _update(tree, _td(seed=3, global_batch_size=8), "token-mean")
    assert_not_close("critic update of another batch", ref, got, atol=1e-4)
    real = tverl.packed_forward

    def row_causal(model, batch, **kw):
        broken = dataclasses.replace(batch, subtree_end=torch.full_like(batch.subtree_end, batch.seq_len), _cache={})
        return real(model, broken, verify=False, **kw)

    want, mask, _ = _values(stock, _td(compute_loss=False))
    monkeypatch.setattr(tverl, "packed_forward", row_causal)
    broken, _, _ = _values(tree, _td(compute_loss=False))
    assert_not_close("values under a plain causal row mask", want[mask], broken[mask], atol=1e-3)
