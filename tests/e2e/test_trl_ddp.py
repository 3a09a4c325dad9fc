"""``TreepackGRPOTrainer`` under 2-process gloo DDP (accelerate's launch by environment) vs stock TRL.

Each run is two real processes (RANK/WORLD_SIZE/MASTER_* set as ``torchrun`` would); rank 0
writes its per-step loss, grad_norm and completions. Stock and treepack must agree.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.extras import require
from helpers.service import free_port

require("trl")

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import json, sys
sys.path.insert(0, {tests!r})
import trl
from helpers.tiny_trl import run_grpo
from treepack.trainer.trl import TreepackGRPOTrainer
cls = TreepackGRPOTrainer if {packed} else trl.GRPOTrainer
res = run_grpo(cls, workdir={workdir!r}, model_path={model!r}, ddp_backend="gloo", beta=0.05, loss_type="dapo")
import torch.distributed as dist
if dist.get_rank() == 0:
    saved = [h["treepack/saved_fraction"] for h in res["logs"] if "treepack/saved_fraction" in h]
    json.dump({{"loss": res["loss"], "grad_norm": res["grad_norm"], "completions": res["completions"],
               "world": dist.get_world_size(), "saved": saved}}, open({out!r}, "w"))
dist.barrier()  # both ranks are done with every collective before gloo is torn down
dist.destroy_process_group()
print("RANK_DONE", flush=True)
"""


def _ddp(tmp_path: Path, packed: bool) -> dict:
    from helpers.tiny_trl import tiny_model

    out = tmp_path / f"{packed}.json"
    model = str(tmp_path / f"init{packed}")
    tiny_model().save_pretrained(model)  # once, before the ranks load it
    code = WORKER.format(
        tests=str(ROOT / "tests"), packed=packed, workdir=str(tmp_path / f"w{packed}"), model=model, out=str(out)
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", code],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = [p.communicate(timeout=400)[0] for p in procs]
    # gloo on CPU now and then aborts a process (SIGABRT) at interpreter exit, after its group was
    # destroyed: a rank that printed RANK_DONE had finished all its work, so only that is let pass.
    ok = [p.returncode == 0 or (p.returncode == -signal.SIGABRT and "RANK_DONE" in log) for p, log in zip(procs, logs)]
    assert all(ok), "\n".join(x[-3000:] for x in logs)
    return json.loads(out.read_text())


def test_ddp_gloo_two_processes_match_stock(tmp_path):
    stock = _ddp(tmp_path, packed=False)
    packed = _ddp(tmp_path, packed=True)
    assert stock["world"] == packed["world"] == 2
    assert packed["completions"] == stock["completions"]
    assert packed["loss"] == pytest.approx(stock["loss"], abs=1e-5, rel=1e-4)
    assert packed["grad_norm"] == pytest.approx(stock["grad_norm"], abs=1e-5, rel=1e-4)
    assert packed["saved"] and min(packed["saved"]) > 0.3
