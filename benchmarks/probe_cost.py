"""CPU benchmark: the cost of the run-time probe against one training step.

Usage:
    python benchmarks/probe_cost.py [--scale 64] [--hidden 256] [--layers 4] [--repeats 3] [--json out.json] [--smoke]
    python benchmarks/probe_cost.py --probe-only [--repeats 3] [--json out.json]

The model and step are those of ``benchmarks/cpu_train_step.py`` (a Qwen3 of ``--hidden`` x
``--layers``, the golden example scaled by ``--scale``, one tree-packed SDPA step: forward,
SFT loss, backward). Measured in the same run, each ``--repeats`` times:

- ``step``: one packed training step (the probe already done for this setup);
- ``probe``: :func:`~treepack.trainer.hf.admission.verify_model` on a fresh setup (the
  remembered probes dropped first), in eval and in train mode with gradient checkpointing.

Time: median and range of the repeats, the three run in turn. Memory: the growth of the
peak resident set of a fresh process over the same model and batch, for one step and for
one probe (each in its own child process, Linux ``VmHWM`` reset after setup), so each
figure is that operation's own peak.

``--probe-only`` times the probe alone, per setup (eval; train; train with gradient
checkpointing; train under bf16 autocast), ``--repeats`` times in turn, after one warm-up
probe, in milliseconds (``--clock cpu --threads 1``: the process's CPU time, for a loaded
machine): the figure to compare between two versions of treepack (run the script once per
version, alternating, on the same machine). A setup the version refuses is
recorded as refused, with the first line of its error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from cpu_train_step import CLOCK, build_model, machine, packed_step, workload_args  # noqa: E402
from golden_scaled import scaled_golden  # noqa: E402

from treepack.service.planner import plan_batch, validate_plan  # noqa: E402
from treepack.trainer import materialize  # noqa: E402
from treepack.trainer.hf.admission import forget_probes, verify_model  # noqa: E402


def setup(scale: int, hidden: int, layers: int, vocab: int):
    case = scaled_golden(scale, vocab=vocab)
    model = build_model(vocab, hidden, layers)
    plan = plan_batch(
        case["sequences"],
        seq_len=case["seq_len"],
        min_shared_len=case["min_shared_len"],
        trainable=case["trainable"],
        groups=case["groups"],
    )
    validate_plan(plan, case["sequences"], trainable=case["trainable"])
    return model, materialize(plan, case["sequences"], trainable=case["trainable"], groups=case["groups"])


def _interleaved(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Wall times of each of ``fns``, run in turn ``repeats`` times (a shared machine's load
    drifts; interleaving spreads the drift over every row alike)."""
    out: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            out[k].append(time.perf_counter() - t0)
    return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def child(what: str, scale: int, hidden: int, layers: int, vocab: int) -> int:
    """Peak RSS growth (KiB) of one ``step`` or one ``probe`` in this fresh process: the peak
    (``VmHWM``, reset through ``/proc/self/clear_refs`` after setup) minus the RSS before."""
    model, batch = setup(scale, hidden, layers, vocab)
    with torch.no_grad():
        model(input_ids=batch.input_ids[:1, :16])  # imports and lazy inits out of the figure
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    if what == "step":
        packed_step_unverified(model, batch)
    else:
        verify_model(model)
    return _status_kib("VmHWM") - before


def packed_step_unverified(model, batch) -> None:
    from treepack.trainer.hf import packed_forward
    from treepack.trainer.losses import sft_loss

    logits = packed_forward(model, batch, verify=False)
    sft_loss(batch.target_logprobs(logits), batch, normalization="token").backward()


def run(scale: int, hidden: int, layers: int, vocab: int, repeats: int) -> dict:
    model, batch = setup(scale, hidden, layers, vocab)
    model.eval()
    packed_step(model, batch, "sdpa")  # warm-up, and this setup's probe

    def fresh_probe() -> None:
        forget_probes(model)
        verify_model(model)

    def train_probe() -> None:
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        try:
            fresh_probe()
        finally:
            model.gradient_checkpointing_disable()
            model.eval()

    t = _interleaved(
        {"step": lambda: packed_step(model, batch, "sdpa"), "eval": fresh_probe, "train": train_probe}, repeats
    )
    step, probe_eval, probe_train = t["step"], t["eval"], t["train"]
    args = [str(scale), str(hidden), str(layers), str(vocab)]
    mem = {
        w: int(
            subprocess.run(
                [sys.executable, __file__, "--child", w, *args], check=True, capture_output=True, text=True
            ).stdout.split()[-1]
        )
        for w in ("step", "probe")
    }
    rows = [
        dict(what="one training step (tree / sdpa)", times=step),
        dict(what="probe, eval mode", times=probe_eval),
        dict(what="probe, train + checkpointing", times=probe_train),
    ]
    med = statistics.median(step)
    for r in rows:
        r["median_s"] = statistics.median(r["times"])
        r["ratio"] = r["median_s"] / med
    return dict(
        machine=machine(),
        model=dict(hidden=hidden, layers=layers, vocab=vocab),
        scale=scale,
        rows_x_len=f"{batch.num_rows} x {batch.seq_len}",
        repeats=repeats,
        results=rows,
        peak_rss_growth_kib=mem,
    )


PROBE_SETUPS = {
    "eval": ("eval", None),
    "train": ("train", None),
    "train + checkpointing": ("train+ckpt", None),
    "train, bf16 autocast": ("train", torch.bfloat16),
}


def _probe_in(model: torch.nn.Module, mode: str, autocast: torch.dtype | None) -> Callable[[], str]:
    """A fresh probe of ``model`` in ``mode`` under ``autocast``: returns "" or the refusal's first line."""

    def probe() -> str:
        model.train(mode != "eval")
        if mode == "train+ckpt":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        forget_probes(model)
        try:
            with torch.autocast("cpu", dtype=autocast) if autocast is not None else nullcontext():
                verify_model(model)
            return ""
        except Exception as e:  # noqa: BLE001 - a version that refuses the setup: recorded, not raised
            return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        finally:
            model.gradient_checkpointing_disable()
            model.eval()

    return probe


def probe_only(scale: int, hidden: int, layers: int, vocab: int, repeats: int, clock: str = "wall") -> dict:
    """Milliseconds of one fresh probe per setup of :data:`PROBE_SETUPS`, ``repeats`` times in turn, by
    ``clock`` (``wall``, or ``cpu``: this process's CPU time)."""
    now = CLOCK[clock]
    model, _ = setup(scale, hidden, layers, vocab)
    probes = {name: _probe_in(model, mode, ac) for name, (mode, ac) in PROBE_SETUPS.items()}
    probes["eval"]()  # imports and lazy inits out of the figures
    times: dict[str, list[float]] = {k: [] for k in probes}
    refused: dict[str, str] = {}
    for _ in range(repeats):
        for k, fn in probes.items():
            t0 = now()
            err = fn()
            times[k].append(1e3 * (now() - t0))
            if err:
                refused[k] = err
    import treepack.trainer

    rows = [
        dict(setup=k, times_ms=v, median_ms=statistics.median(v), refused=refused.get(k, "")) for k, v in times.items()
    ]
    return dict(
        machine=machine(),
        treepack=treepack.trainer.__file__,
        model=dict(hidden=hidden, layers=layers, vocab=vocab),
        repeats=repeats,
        results=rows,
    )


def main(argv: list[str] | None = None) -> dict:
    args = workload_args(
        __doc__.splitlines()[0],
        argv,
        lambda ap: (
            ap.add_argument(
                "--child", nargs=5, metavar=("WHAT", "SCALE", "HIDDEN", "LAYERS", "VOCAB"), help=argparse.SUPPRESS
            ),
            ap.add_argument("--probe-only", action="store_true", help="the probe alone, in ms per setup"),
        ),
    )
    if args.child:
        print(child(args.child[0], *map(int, args.child[1:])))
        return {}
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe_only:
        out = probe_only(args.scale, args.hidden, args.layers, args.vocab, args.repeats, args.clock)
        model = f"Qwen3 hidden {args.hidden} x {args.layers} layers"
        print(f"# {out['machine']}; {out['treepack']}; {model}; {args.clock} ms")
        for r in out["results"]:
            spread = f"{min(r['times_ms']):.0f}-{max(r['times_ms']):.0f}"
            print(f"| {r['setup']} | {r['median_ms']:.0f} | {spread} | {r['refused'] or 'accepted'} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return out
    out = run(args.scale, args.hidden, args.layers, args.vocab, args.repeats)
    print(
        f"# {out['machine']}; golden / {out['scale']} ({out['rows_x_len']} rows), "
        f"Qwen3 hidden {args.hidden} x {args.layers} layers, {args.repeats} repeats"
    )
    print("| what | median s | range s | / one step |")
    print("|---|---:|---:|---:|")
    for r in out["results"]:
        print(f"| {r['what']} | {r['median_s']:.3f} | {min(r['times']):.3f}-{max(r['times']):.3f} | {r['ratio']:.2f} |")
    m = out["peak_rss_growth_kib"]
    print(
        f"\npeak RSS growth: one step {m['step'] / 1024:.1f} MiB, one probe {m['probe'] / 1024:.1f} MiB "
        f"({m['probe'] / max(m['step'], 1):.2f} of a step)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
