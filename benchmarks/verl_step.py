"""Wall time of one verl policy update (``train_batch``), stock engine vs ``TreepackFSDPEngine`` (CPU).

verl 0.9.1's ``FSDPEngineWithLMHead`` and the treepack engine, FSDP2 on one CPU gloo rank
(the test suite's CPU shim, ``tests/verl_engine/cpu_shim.py``), fp32, a random Qwen2, one GRPO
mini-batch: G prompts of about P tokens, 8 responses each of at most R tokens, micro-batches
of one group (8 sequences). Both engines start from the same checkpoint and are built before
any timing; the repeats interleave the two engines (the order alternates), after one warm-up
update each; each update is undone before the next. Prints the 1-minute load average seen
during the run and a markdown row: median times (min-max), the
stock / treepack ratio per repeat (median, min-max), and it over the token ratio
(tokens of the sequences / tokens the tree rows hold).

    .venv-verl/bin/python benchmarks/verl_step.py --groups 4 --prompt-len 384 --response-len 48 --threads 1

The stock engine is timed in both of its layouts in the same run: remove-padding (verl's
default: the micro-batch as one row) and padded (``use_remove_padding=False``: one row per
sequence); the treepack engine under each ``--backends`` entry (default ``sdpa``, the dense
tree mask, and ``auto``, the default: the copy-free varlen path on a CPU), and ``treepack
previous``: the engine as it was before its profile-driven fixes (the dense-mask ``sdpa``
backend and the row length that left out each response's copy of the join token,
:func:`previous_row_len`), the baseline in the same run (``--no-previous`` skips it).

Where an update's time goes (printed under the table): per engine, the median
over repeats of ``forward_step`` (all micro-batches: the forward and the loss; for treepack
also, inside it, ``plan + materialize`` and ``packed forward + head``) and the rest of
``train_batch`` (backward, optimizer step, verl's own bookkeeping).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests", "verl_engine")]

import cpu_shim  # noqa: E402

cpu_shim.install(init_file=tempfile.mktemp(prefix="treepack-verl-bench-"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from engines import build, flags, grpo_batch, loss_fn, params, restore  # noqa: E402
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead  # noqa: E402

import treepack.trainer.verl as tverl  # noqa: E402
from treepack.trainer.verl import TreepackFSDPEngine, VerlPacking  # noqa: E402

CURRENT_ROW_LEN = tverl._row_len


def previous_row_len(seq_lens, prompt_lens, groups, packing) -> int:
    """The row-length rule before the join tokens were counted (prompt + all its responses)."""
    tree = np.bincount(groups, weights=seq_lens - prompt_lens, minlength=1)
    first = np.unique(groups, return_index=True)[1]
    tree[groups[first]] += prompt_lens[first]
    need = max(int(seq_lens.max(initial=1)), min(int(tree.max(initial=1)), packing.max_seq_len))
    step = 128 if packing.backend == "flex" else 16
    return -(-need // step) * step


PARTS: dict[str, float] = {}


def _timed(cls, name: str, label: str) -> None:
    fn = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            PARTS[label] = PARTS.get(label, 0.0) + time.perf_counter() - t0

    setattr(cls, name, wrapper)


_timed(FSDPEngineWithLMHead, "forward_step", "forward_step")
_timed(TreepackFSDPEngine, "forward_step", "forward_step")
_timed(TreepackFSDPEngine, "_plan_rows", "plan + materialize")
_timed(TreepackFSDPEngine, "_packed_logprobs", "packed forward + head")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=384)
    ap.add_argument("--response-len", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backends", nargs="+", default=["sdpa", "auto"], help="treepack engine backends to time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--no-previous", action="store_true", help="skip the previous version (sdpa, old row length)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    path = tempfile.mkdtemp(prefix="treepack-verl-bench-model-")
    cfg = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.hidden // 32,
        num_key_value_heads=max(1, a.hidden // 64),
        max_position_embeddings=4096,
    )
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    n = 8
    batch = lambda rmpad: flags(
        grpo_batch(groups=a.groups, n=n, seed=0, P=a.prompt_len, R=a.response_len, vocab=a.vocab),
        dynamic=False,
        rmpad=rmpad,
        micro=n,
        global_batch_size=a.groups * n,
    )  # noqa: E731
    stock, tree = build(FSDPEngineWithLMHead, path=path), build(TreepackFSDPEngine, path=path)
    # name -> (engine, use_remove_padding); the treepack engine packs whatever the flag says.
    engines = {"stock remove-padding": (stock, True), "stock padded": (stock, False)}
    engines.update({f"treepack {b}": (tree, True) for b in a.backends})
    if not a.no_previous:
        engines["treepack previous"] = (tree, True)
    start = {id(e): params(e) for e in (stock, tree)}
    times: dict[str, list[float]] = {k: [] for k in engines}
    parts: dict[str, list[dict[str, float]]] = {k: [] for k in engines}
    saved: dict[str, list[float]] = {}
    loads = []
    for rep in range(a.repeats + 1):  # repeat 0 warms both up; the order alternates per repeat
        order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
        for name in order:
            eng, rmpad = engines[name]
            if eng is tree:
                previous = name == "treepack previous"
                eng.packing = VerlPacking(backend="sdpa" if previous else name.removeprefix("treepack "))
                tverl._row_len = previous_row_len if previous else CURRENT_ROW_LEN
            td = batch(rmpad)
            loads.append(os.getloadavg()[0])
            PARTS.clear()
            t0 = time.perf_counter()
            with eng.train_mode():
                out = eng.train_batch(td, loss_function=loss_fn("token-mean"))
            if rep:
                times[name].append(time.perf_counter() - t0)
                parts[name].append(dict(PARTS, rest=times[name][-1] - PARTS.get("forward_step", 0.0)))
            restore(eng, start[id(eng)])
            if eng is tree:
                saved[name] = out["metrics"]["treepack/saved_fraction"].values
    tverl._row_len = CURRENT_ROW_LEN
    med = {k: statistics.median(v) for k, v in times.items()}
    # Tokens of the sequences / tokens the tree rows hold (the same plan under every backend).
    token_ratio = 1 / (1 - statistics.mean(saved[f"treepack {a.backends[-1]}"]))
    packed = [k for k in engines if k.startswith("treepack")]
    cell = lambda k: f"{med[k] * 1e3:,.0f} ms ({min(times[k]) * 1e3:,.0f}-{max(times[k]) * 1e3:,.0f})"  # noqa: E731
    # Stock / treepack per repeat (both timed in the same repeat): the speedup's median and spread.
    paired = lambda k, t: [s / p for s, p in zip(times[k], times[t])]  # noqa: E731
    spread = lambda xs: f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"  # noqa: E731
    print(
        f"1-min load average during the run: {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} CPUs; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{a.groups}x{n} sequences, P~{a.prompt_len}, R<={a.response_len}, Qwen2 {a.layers}x{a.hidden}, "
        f"vocab {a.vocab}; {a.repeats} repeats"
    )
    print("| stock layout | stock | treepack backend | treepack | stock / treepack | / token ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for k in ("stock remove-padding", "stock padded"):
        for t in packed:
            speed = paired(k, t)
            print(
                f"| {k.removeprefix('stock ')} | {cell(k)} | {t.removeprefix('treepack ')} | {cell(t)} | "
                f"{spread(speed)}x | {spread([x / token_ratio for x in speed])} (token ratio {token_ratio:.2f}x) |"
            )
    labels = ("forward_step", "plan + materialize", "packed forward + head", "rest")
    print("\n| engine (ms per update, median) | " + " | ".join(labels) + " |")
    print("| --- |" + " ---: |" * len(labels))
    for k, runs in parts.items():
        cells = [f"{statistics.median(r.get(x, 0.0) for r in runs) * 1e3:,.1f}" for x in labels]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
