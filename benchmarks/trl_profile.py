"""Where a TRL GRPO step's time goes: stock ``trl.GRPOTrainer`` vs ``TreepackGRPOTrainer`` (CPU).

Usage:
    python benchmarks/trl_profile.py [--repeats 5] [--steps 4] [--prompt-len 512] [--completion-len 64]
                                     [--backend sdpa] [--json out.json]

The shape and model of ``benchmarks/trl_grpo.py`` (G prompts x 8 completions, a random Qwen3,
beta > 0 so the reference pass runs). Each repeat trains both trainers from the same seed
(their order alternates between repeats, so both see the machine's load alike) with wall
timers around the parts of a step:

- ``generation``: ``_generate_single_turn`` (the same work on both sides: not packing's);
- ``reference pass`` and ``policy forward``: ``_get_per_token_logps_and_entropies`` without and
  with gradients; for treepack, inside them: ``read padded`` (``from_padded``), ``plan``,
  ``materialize``, ``admission`` (``admit``), ``attention metadata`` (the dense mask, the
  BlockMask or the varlen calls, built once per batch), ``model`` (the packed forward through
  TRL's fused head), ``to padded``;
- ``backward`` (``accelerator.backward``) and ``optimizer step``;
- ``rest``: the step's wall time (from one ``training_step`` start to the next) minus all of
  these (TRL's scoring and advantages, zeroing the gradients, logging).

Three trainers per repeat, their order rotating (a first repeat warms them up and is not
counted): ``stock``, ``treepack`` (the current
default, or ``--backend``) and ``treepack previous``: the step as it was before its
profile-driven fixes (the dense-mask ``sdpa`` backend and the row length that left out the
join tokens, :func:`previous_seq_len`), the baseline in the same run.

Figures per step (ms): in each run the median over its steps after the first (``first step``:
the first one's wall time, which pays the imports and treepack's one-time admission and
probe), then the median over repeats with (min-max); ``training`` is wall minus generation,
and ``speedup / token ratio`` divides the training speedup by the token ratio of the plans
(unpacked / packed tokens).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from trl_grpo import run  # noqa: E402

TIMES: collections.Counter = collections.Counter()


@contextlib.contextmanager
def timed(label: str):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        TIMES[label] += time.perf_counter() - t0


def _wrap(owner: Any, name: str, label: str | Any) -> None:
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        lab = label(*args, **kwargs) if callable(label) else label
        with timed(lab):
            return fn(*args, **kwargs)

    setattr(owner, name, wrapper)


def instrument() -> None:
    """Wall timers around the parts of a step (module docstring), both trainers."""
    import trl
    from trl.trainer import grpo_trainer

    import treepack.trainer.trl.grpo as tgrpo
    import treepack.trainer.trl.step as tstep
    from treepack.trainer.data.packed_batch import PackedBatch
    from treepack.trainer.planning.bridge import PaddedSequences
    from treepack.trainer.trl.step import PackedRows

    pass_label = lambda *a, **k: "policy forward" if torch.is_grad_enabled() else "reference pass"  # noqa: E731
    _wrap(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", pass_label)
    _wrap(tgrpo.TreepackGRPOTrainer, "_get_per_token_logps_and_entropies", pass_label)
    _wrap(trl.GRPOTrainer, "_generate_single_turn", "generation")
    _wrap(tgrpo, "from_padded", "tp: read padded")
    _wrap(tgrpo, "materialize", "tp: materialize")
    _wrap(PackedRows, "_plan", "tp: plan")
    _wrap(tstep, "admit", "tp: admission")
    _wrap(PackedRows, "_packed_fused", "tp: packed call")
    _wrap(PaddedSequences, "to_padded", "tp: to padded")
    for name in ("dense_mask", "block_mask", "varlen_meta", "varlen_levels"):
        _wrap(PackedBatch, name, "tp: attention metadata")
    del grpo_trainer


def _train(cls, a, workdir: str, **extra) -> dict:
    """One training run; per-step ms by part, the median over the steps after the first
    (the first pays one-time costs: imports, the model's admission and probe)."""
    marks: list[tuple[float, dict[str, float]]] = []  # (time, timers) at each step's start

    class Profiled(cls):
        def create_optimizer(self, *args, **kwargs):
            opt = super().create_optimizer(*args, **kwargs)
            _wrap(getattr(opt, "optimizer", opt), "step", "optimizer step")
            return opt

        def training_step(self, *args, **kwargs):
            if not getattr(self.accelerator, "_timed", False):
                _wrap(self.accelerator, "backward", "backward")
                self.accelerator._timed = True
            marks.append((time.perf_counter(), dict(TIMES)))
            return super().training_step(*args, **kwargs)

    TIMES.clear()
    r = run(Profiled, a, workdir, **extra)
    # A step runs from one training_step's start to the next (the optimizer step and TRL's
    # logging come after training_step returns); the last one ends with train().
    marks.append((r["end"], dict(TIMES)))
    steps = []
    for (t0, before), (t1, after) in zip(marks, marks[1:]):
        step = {k: (v - before.get(k, 0.0)) * 1e3 for k, v in after.items()}
        step["wall"] = (t1 - t0) * 1e3
        steps.append(step)
    kept = steps[1:] or steps
    keys = {k for st in kept for k in st}
    parts = {k: statistics.median(st.get(k, 0.0) for st in kept) for k in keys}
    parts["first step"] = steps[0]["wall"]
    parts["training"] = statistics.median(st["wall"] - st.get("generation", 0.0) for st in kept)
    inside = ("tp: read padded", "tp: plan", "tp: materialize", "tp: to padded", "tp: packed call")
    if "tp: packed call" in parts:
        own = parts.get("tp: admission", 0) + parts.get("tp: attention metadata", 0)
        parts["tp: model"] = parts["tp: packed call"] - own
        parts["tp: logps bookkeeping"] = (
            parts.get("reference pass", 0) + parts.get("policy forward", 0) - sum(parts.get(k, 0) for k in inside)
        )
    top = ("generation", "reference pass", "policy forward", "backward", "optimizer step")
    parts["rest"] = parts["wall"] - sum(parts.get(k, 0) for k in top)
    logged = [h for h in r["logs"] if "loss" in h]
    saved = [h["treepack/saved_fraction"] for h in logged if "treepack/saved_fraction" in h]
    if saved:
        parts["token ratio"] = 1 / (1 - sum(saved) / len(saved))
    parts["rewards"] = [h["reward"] for h in logged]
    return parts


ROWS = (
    "first step",
    "wall",
    "generation",
    "training",
    "reference pass",
    "policy forward",
    "backward",
    "optimizer step",
    "rest",
    "tp: read padded",
    "tp: plan",
    "tp: materialize",
    "tp: admission",
    "tp: attention metadata",
    "tp: model",
    "tp: to padded",
    "tp: logps bookkeeping",
)


def _cell(xs: list[float]) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):,.0f} ({min(xs):,.0f}-{max(xs):,.0f})"


def previous_seq_len(padded, config) -> int:
    """The row-length rule before the join tokens were counted (prompt + completions)."""
    import numpy as np

    if config.seq_len is not None:
        return int(config.seq_len)
    lens = padded.lengths
    tree = np.bincount(padded.groups, weights=padded.completion_lens, minlength=1)
    first = np.unique(padded.groups, return_index=True)[1]
    tree[padded.groups[first]] += padded.prompt_lens[first]
    need = max(int(lens.max(initial=1)), min(int(tree.max(initial=1)), config.max_seq_len))
    return -(-need // 16) * 16


@contextlib.contextmanager
def previous_version():
    """The TRL step as it was: the dense-mask sdpa backend (given by the caller) and the row-length rule above."""
    import treepack.trainer.trl.step as tstep

    current = tstep.choose_seq_len
    tstep.choose_seq_len = previous_seq_len
    try:
        yield
    finally:
        tstep.choose_seq_len = current


def main() -> None:
    import trl

    from treepack.trainer.trl import PackingConfig, TreepackGRPOTrainer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step (8 completions each)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--completion-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--words", type=int, default=1000)
    p.add_argument("--bf16", action="store_true", help="TRL's bf16 autocast on both sides (default: fp32)")
    p.add_argument("--backend", default=None, help="PackingConfig.backend (default: PackingConfig's)")
    p.add_argument("--no-previous", action="store_true", help="skip the previous version (sdpa, old row length)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    instrument()
    packing = PackingConfig(min_shared_len=16, **({} if a.backend is None else {"backend": a.backend}))
    runs = {
        "stock": lambda d: _train(trl.GRPOTrainer, a, d),
        "treepack": lambda d: _train(TreepackGRPOTrainer, a, d, packing=packing),
    }
    if not a.no_previous:
        previous = PackingConfig(min_shared_len=16, backend="sdpa")

        def run_previous(d):
            with previous_version():
                return _train(TreepackGRPOTrainer, a, d, packing=previous)

        runs["treepack previous"] = run_previous
    results: dict[str, list[dict]] = {k: [] for k in runs}
    names = list(runs)
    with tempfile.TemporaryDirectory() as d:
        for rep in range(a.repeats + 1):  # repeat 0 warms every trainer up (imports, first calls): not counted
            for who in names[rep % len(names) :] + names[: rep % len(names)]:
                r = runs[who](f"{d}/{who.replace(' ', '_')}{rep}")
                print(f"repeat {rep} {who}: training {r['training']:.0f} ms/step", flush=True)
                if rep:
                    results[who].append(r)
    ratio = statistics.median(t["token ratio"] for t in results["treepack"])
    print(
        f"\nmachine: {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), trl {trl.__version__}; treepack backend {packing.backend}; "
        f"{a.prompts} x 8, P {a.prompt_len} / C {a.completion_len}, Qwen3 {a.layers}x{a.hidden}, "
        f"{'bf16' if a.bf16 else 'fp32'}; {a.repeats} repeats x {a.steps} steps"
    )
    packed = [k for k in names if k != "stock"]
    print("\n| part (ms / step) | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for row in ROWS:
        cells = [[x[row] for x in results[k] if row in x] for k in names]
        if any(cells):
            print(f"| {row} | " + " | ".join(_cell(c) for c in cells) + " |")
    summary = {}
    for k in packed:
        same = all(s["rewards"] == t["rewards"] for s, t in zip(results["stock"], results[k]))
        speed = [s["training"] / t["training"] for s, t in zip(results["stock"], results[k])]
        summary[k] = dict(speedup=speed, same_rewards=same)
        print(
            f"\n{k}: training speedup {statistics.median(speed):.2f}x ({min(speed):.2f}-{max(speed):.2f}), "
            f"token ratio {ratio:.2f}, speedup / token ratio {statistics.median(speed) / ratio:.2f} "
            f"({min(speed) / ratio:.2f}-{max(speed) / ratio:.2f}); same rewards as stock: {same}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "results": results, "summary": summary, "token_ratio": ratio}, f, indent=1)


if __name__ == "__main__":
    main()
