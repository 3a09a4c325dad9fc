"""TreepackFSDPEngine against stock verl on 2 gloo ranks with FSDP2 (``two_ranks.py`` is one rank).

Each rank holds half of one GRPO batch (verl's dispatch split); FSDP2 shards the parameters
over both ranks and reduces the gradients. Checked: the log-probs and entropies of
``infer_batch`` on every rank, and the ``train_batch`` update (SGD lr 1: the reduced
gradient). The update is also checked against one rank running the whole batch (so the
reduction over ranks really happened: each rank alone sees half the batch), with a
negative control: one rank running only the first half gives another update.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from engines import PARITY, build, flags, grpo_batch, model_dir, update
from verl.utils import tensordict_utils as tu
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from helpers.tolerance import assert_close, assert_not_close

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def two_ranks():
    out = tempfile.mkdtemp(prefix="treepack-verl-2ranks-")
    init = tempfile.mktemp(prefix="treepack-verl-2ranks-gloo-")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "two_ranks.py"), str(r), init, model_dir(), out],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return torch.load(os.path.join(out, "result.pt"))


def _one_rank_update(first_half_only: bool) -> dict[str, torch.Tensor]:
    """Stock verl on this process's one rank: the update of the 2-rank batch (or its first half)."""
    td = grpo_batch(groups=4, n=4, seed=2)
    if first_half_only:
        td = tu.chunk_tensordict(td, 2)[0]
    return update(
        build(FSDPEngineWithLMHead),
        flags(td, dynamic=False, rmpad=True, calculate_entropy=False, global_batch_size=td.batch_size[0]),
    )


def test_two_ranks_infer_and_update_match_stock(two_ranks):
    r = two_ranks
    assert r["validated"] > 0  # the engine's plans on rank 0 passed validate_plan
    assert r["saved_min"] > 0  # every micro-batch on both ranks shared its prompt
    assert r["logp_err"] <= 1e-5 and r["ref_logp_max"] > 0, r
    assert r["entropy_err"] <= 1e-5, r
    assert_close("2-rank update", r["stock"], r["tree"], ratio=1e-4, nonzero_ref=True)
    err = max((r["stock"][k] - r["tree"][k]).abs().max().item() for k in r["stock"])
    PARITY.append(("2 gloo ranks FSDP2 infer + update token-mean", r["logp_err"], r["entropy_err"], err))


def test_two_ranks_reduce_the_gradient(two_ranks):
    """The 2-rank update is the whole batch's (gradients reduced over ranks), not one half's."""
    whole = _one_rank_update(False)
    assert_close("2 ranks vs 1 rank on the whole batch", whole, two_ranks["stock"], ratio=1e-4, nonzero_ref=True)
    assert_close(
        "2 ranks (treepack) vs 1 rank on the whole batch", whole, two_ranks["tree"], ratio=1e-4, nonzero_ref=True
    )
    first_half = _one_rank_update(True)
    assert_not_close("1 rank on the first half only", first_half, two_ranks["stock"], atol=1e-4)
