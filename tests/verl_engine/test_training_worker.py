"""verl's ``TrainingWorker`` (``verl/workers/engine_workers.py``) driving TreepackFSDPEngine, no Ray.

In verl 0.9.1 the actor's and the reference model's log-probs (``compute_log_prob``,
``compute_ref_log_prob``) and the policy update (``update_actor``) are the inner
``TrainingWorker``'s ``infer_batch`` and ``train_mini_batch``. The worker is built in this
process the way ``ActorRolloutRefWorker.init_model`` builds it (a ``TrainingWorkerConfig``,
the engine looked up in verl's registry, ``reset()``, ``set_loss_fn(ppo_loss)``), once with
the stock registry and once after ``verl_plugin.register()``; the data carries the keys the
PPO trainer assigns. Needs ``uvicorn`` and ``fastapi`` (imported by the worker module).
"""

from __future__ import annotations

import os

import pytest
from engines import PARITY, configs, grpo_batch, loss_fn, params, stock_registry
from verl.utils import tensordict_utils as tu
from verl.workers.config import TrainingWorkerConfig
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.padding import no_padding_2_padding

from treepack.trainer import verl_plugin
from treepack.trainer.verl import TreepackFSDPEngine

from helpers.tolerance import assert_close, assert_not_close


def _worker(treepack: bool) -> TrainingWorker:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # Worker.__init__ reads them (the group already exists)
    os.environ.setdefault("MASTER_PORT", "29533")
    with stock_registry():
        if treepack:
            verl_plugin.register()
        cfg = TrainingWorkerConfig(model_type="language_model", **configs(use_remove_padding=True))
        worker = TrainingWorker(cfg)
    worker.reset()
    worker.set_loss_fn(loss_fn("token-mean"))
    return worker


@pytest.fixture(scope="module")
def workers():
    stock, tree = _worker(False), _worker(True)
    assert type(stock.engine) is FSDPEngineWithLMHead and type(tree.engine) is TreepackFSDPEngine
    return stock, tree


def _values(metric) -> list[float]:
    """A worker metric's values (a verl ``Metric``, or a list of them / of numbers after the dp gather)."""
    items = metric if isinstance(metric, list) else [metric]
    return [float(v) for m in items for v in (m.values if hasattr(m, "values") else [m])]


def _log_probs(worker, seed=1):
    """``compute_log_prob`` as the PPO trainer calls it (temperature 0.7, with entropy)."""
    td = grpo_batch(groups=2, n=4, seed=seed)
    tu.assign_non_tensor(td, temperature=0.7, calculate_entropy=True, compute_loss=False)
    out = worker.infer_batch(td)
    mask = (
        td["response_mask"].to_padded_tensor(0).bool() if td["response_mask"].is_nested else td["response_mask"].bool()
    )
    return (
        no_padding_2_padding(out["log_probs"], td)[mask],
        no_padding_2_padding(out["entropy"], td)[mask],
        tu.get(out, "metrics"),
    )


def _update_actor(worker, seed=2):
    """``update_actor``: 4 groups x 4, mini-batches of 8 (two SGD steps), no shuffle."""
    td = grpo_batch(groups=4, n=4, seed=seed)
    tu.assign_non_tensor(
        td,
        temperature=1.0,
        calculate_entropy=False,
        global_batch_size=8,
        mini_batch_size=8,
        epochs=1,
        seed=42,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    before = params(worker.engine)
    out = worker.train_mini_batch(td)
    after = params(worker.engine)
    return {k: before[k] - after[k] for k in before}, tu.get(out, "metrics")


def test_worker_infer_batch_matches_stock(workers):
    stock, tree = workers
    lp_ref, ent_ref, _ = _log_probs(stock)
    lp, ent, metrics = _log_probs(tree)
    assert_close("worker log_probs", lp_ref, lp, atol=1e-5, nonzero_ref=True)
    assert_close("worker entropy", ent_ref, ent, atol=1e-5, nonzero_ref=True)
    saved = _values(metrics["treepack/saved_fraction"])
    assert saved and min(saved) > 0, saved
    PARITY.append(
        (
            "TrainingWorker.infer_batch",
            (lp - lp_ref).abs().max().item(),
            (ent - ent_ref).abs().max().item(),
            float("nan"),
        )
    )


def test_worker_train_mini_batch_matches_stock(workers):
    stock, tree = workers
    ref, m_ref = _update_actor(stock)
    got, metrics = _update_actor(tree)
    assert_close("worker update (2 mini-batches)", ref, got, ratio=1e-4, nonzero_ref=True)
    assert _values(metrics["treepack/rows"]) and "treepack/rows" not in m_ref
    err = max((ref[k] - got[k]).abs().max().item() for k in ref)
    PARITY.append(("TrainingWorker.train_mini_batch (2 mini-batches)", float("nan"), float("nan"), err))
    # Negative control: the next update (the weights moved by the first) differs.
    again, _ = _update_actor(stock)
    assert_not_close("the second update", ref, again, atol=1e-4)
