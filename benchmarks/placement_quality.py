"""Placement quality and scaling: rows against the lower bound and the exact optimum, and
``auto`` against ``bfd`` from 3,072 to 30,720 groups (the figures in BENCHMARKS.md).

Usage:
    python benchmarks/placement_quality.py quality [--per-family 36] [--node-limit 50000] [--ms 10]
    python benchmarks/placement_quality.py scaling [--groups 3072 7680 30720]
    python benchmarks/placement_quality.py sharing
    python benchmarks/placement_quality.py hard [--seeds 16] [--node-limit 50000] [--ms 10]
    python benchmarks/placement_quality.py budget [--repeats 3]
    python benchmarks/placement_quality.py best RUN.json [RUN.json ...]

``quality`` plans small and medium instances (realistic GRPO curriculum, agentic,
distillation, SFT and the golden example at reduced row sizes, plus adversarial ones: leaves
just over a half, third or quarter of a row behind one prefix, and near-perfect packings
cut into pieces and shuffled) with ``auto`` (at the default repair budget, or ``--ms``, and at 1 s),
``auto`` without the repair pass, and ``bfd``, and searches the optimum between the lower
bound and ``auto``'s rows with the exact branch and bound
(:func:`~treepack.service.planner.optimum.exact_min_rows`); an optimum counts as proven
when every smaller row count was refuted within the node limit.

``scaling`` plans each curriculum once with ``bfd`` and once with ``auto`` (the 30,720-group
batch has ~267k completions and ~1.0G tokens, ~4.4 GB of memory) and prints the phase
times and the ratios the issue sets targets for, measured in the same run: ``auto``
placement / ``bfd`` placement, and ``auto``'s whole ``plan_batch`` / its own tree build.

``hard`` runs the classes where 12-row neighbourhoods of light rows are not enough
(``tests/helpers/hard_instances.py``: cross-tree sharing, agent trees with deep chains, GRPO
with 80+ completions, random trees) at three sizes (7-12, 19-24 and 31-36 leaves; GRPO
80-130 and 120-170) against the exact optimum, with ``auto`` at the default repair budget
(10 ms, or ``--ms``), at 1,000 ms (what a cost model buys a row of seconds), and at 1,000 ms without the
wide levels (``narrow``: 12-row neighbourhoods of light rows only, the repair pass before it
learned to widen); planning ms are ``place_leaves`` CPU times of the planning thread
(``time.thread_time``, what the repair budget counts too), median and max.

``budget`` plans the realistic workloads (the curriculum at 768 groups, agentic at 256
tasks, distillation at 512 sources, the golden example; C = 131,072) with ``auto`` at
repair budgets of 10 ms (the default) and 1,000 ms (a cost model's cap): rows, bound, and
``plan_normalized``'s CPU ms (median, min-max of ``--repeats``) and the repair pass's share.

``best`` reads the ``--json`` outputs of ``quality`` and ``hard`` runs (before and after a
change, say) and prints each run's rows against the best known: per instance, the fewest
rows any search of any of the runs found; ``auto`` at 10 ms (or the run's ``--ms``) and at
1 s, and on which instances each is above it.

``sharing`` compares rule 4 (``min_shared_len``) with the sharing-by-saving option on the
curriculum and on a short-question GRPO batch: rows, tree and packed tokens, segments and
the trainer-side cost proxy (:func:`trainer_cost`).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "tests"))

from treepack.proto.batch import normalize_batch
from treepack.service.cli import workloads as W
from treepack.service.planner.api import plan_normalized
from treepack.service.planner.bounds import lower_bound_rows, min_copies

try:
    from treepack.service.planner.optimum import exact_min_rows
except ImportError:  # the planner before the optimum had its own module (for before/after runs)
    from treepack.service.planner.exact import exact_min_rows  # type: ignore[attr-defined,no-redef]
from treepack.service.planner.placement import place_leaves
from treepack.service.planner.tree import build_tree

from helpers.hard_instances import HARD_FAMILIES, hard_instance  # noqa: E402


def _adversarial(seed: int, n_rows: int, kind: str) -> W.Workload:
    rng = np.random.default_rng([7, seed, n_rows])
    C = int(rng.integers(2000, 8000))
    prefix = rng.integers(0, W.VOCAB, int(rng.integers(0, 200)), dtype=np.uint32)
    room = C - prefix.shape[0]
    if kind == "perfect":
        parts: list[int] = []
        for _ in range(n_rows):
            k = int(rng.integers(2, 6))
            cuts = np.sort(rng.choice(np.arange(1, room - room // 50), k - 1, replace=False))
            parts += np.diff(np.r_[0, cuts, room - int(rng.integers(0, room // 50))]).tolist()
        lens = rng.permutation(parts)
    else:
        frac = {"half": 0.5, "third": 1 / 3, "quarter": 0.25}[kind]
        lens = np.maximum(1, (C * frac * rng.uniform(0.9, 1.15, n_rows * 2)).astype(np.int64) - prefix.shape[0])
    seqs = [np.concatenate([prefix, W._distinct_tokens(rng, int(n), i)]) for i, n in enumerate(lens)]
    return W.Workload(
        name=f"adv-{kind}",
        sequences=seqs,
        trainable=[prefix.shape[0]] * len(seqs),
        groups=list(range(len(seqs))),
        seq_len=C,
    )


def _sft(seed: int, n: int) -> W.Workload:
    rng = np.random.default_rng([8, seed])
    C = 32768
    lens = np.clip(rng.lognormal(np.log(3000), 0.9, n), 64, C).astype(np.int64)
    seqs = [W._distinct_tokens(rng, int(x), i) for i, x in enumerate(lens)]
    return W.Workload(
        name="sft", sequences=seqs, trainable=[min(200, int(x) - 1) for x in lens], groups=list(range(n)), seq_len=C
    )


def instances(per_family: int):
    """(family, workload) pairs of the quality suite (module docstring)."""
    for i in range(per_family):
        yield "curriculum", W.curriculum(2 + i % 12, seed=i, seq_len=(8192, 16384, 32768)[i % 3])
        yield "agentic", W.agentic(2 + i % 6, seed=i, seq_len=(32768, 65536)[i % 2], rollouts=4 + i % 5)
        yield "distillation", W.distillation(2 + i % 8, seed=i, seq_len=(16384, 32768)[i % 2])
        yield "sft", _sft(i, 8 + i % 40)
        yield "golden", W.golden_example(seed=i, scale=(8, 16, 32, 64)[i % 4])
        yield "adversarial", _adversarial(i, 2 + i % 6, ("perfect", "half", "third", "quarter")[i % 4])


def quality(per_family: int, node_limit: int, ms: float = 10.0) -> dict:
    rows = []
    t_start = time.perf_counter()
    for family, w in instances(per_family):
        batch = normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups)
        tree = build_tree(batch, 64)
        C = w.seq_len
        bound = lower_bound_rows(tree, C)
        old_bound = max(1, -(-int((tree.length * min_copies(tree, C)).sum()) // C))
        t = time.thread_time()
        auto = place_leaves(tree, batch, C, "auto", bound=bound, repair_ms=ms)
        auto_ms = (time.thread_time() - t) * 1e3
        t = time.thread_time()
        auto1000 = place_leaves(tree, batch, C, "auto", bound=bound, repair_ms=1000.0).num_rows
        auto1000_ms = (time.thread_time() - t) * 1e3
        greedy = place_leaves(tree, batch, C, "auto", bound=bound, repair_ms=0).num_rows
        bfd = place_leaves(tree, batch, C, "bfd").num_rows
        t = time.perf_counter()
        opt, proven = exact_min_rows(tree, C, bound, min(auto.num_rows, auto1000), node_limit=node_limit)
        rows.append(
            dict(
                index=len(rows),
                family=family,
                leaves=len(w.sequences),
                bound=bound,
                old_bound=old_bound,
                auto=auto.num_rows,
                auto_ms=auto_ms,
                auto_budget_ms=ms,
                auto1000=auto1000,
                auto1000_ms=auto1000_ms,
                greedy=greedy,
                bfd=bfd,
                opt=opt,
                proven=proven,
                strategy=auto.strategy,
                exact_s=time.perf_counter() - t,
            )
        )
    by = Counter()
    for r in rows:
        f = r["family"]
        for key in ("all", f):
            by[key, "n"] += 1
            by[key, "proven"] += r["proven"]
            by[key, "auto=opt"] += r["proven"] and r["auto"] == r["opt"]
            by[key, "greedy=opt"] += r["proven"] and r["greedy"] == r["opt"]
            by[key, "bfd=opt"] += r["proven"] and r["bfd"] == r["opt"]
            by[key, "bound=opt"] += r["proven"] and r["bound"] == r["opt"]
            by[key, "old_bound=opt"] += r["proven"] and r["old_bound"] == r["opt"]
            by[key, "auto>bfd"] += r["auto"] > r["bfd"]
            by[key, "auto=bound"] += r["auto"] == r["bound"]
    print(
        f"{'family':13s} {'n':>4s} {'proven':>6s} {'auto=opt':>8s} {'no-repair=opt':>13s} {'bfd=opt':>7s} "
        f"{'bound=opt':>9s} {'old bound=opt':>13s} {'auto=bound':>10s} {'auto>bfd':>8s}"
    )
    for key in ["all"] + sorted({r["family"] for r in rows}):
        g = lambda k: by[key, k]  # noqa: E731
        print(
            f"{key:13s} {g('n'):4d} {g('proven'):6d} {g('auto=opt'):8d} {g('greedy=opt'):13d} {g('bfd=opt'):7d} "
            f"{g('bound=opt'):9d} {g('old_bound=opt'):13d} {g('auto=bound'):10d} {g('auto>bfd'):8d}"
        )
    gaps = Counter(r["auto"] - r["opt"] for r in rows if r["proven"])
    print("auto - optimum over proven instances:", dict(sorted(gaps.items())))
    print(
        f"unproven: {sum(not r['proven'] for r in rows)} "
        f"(auto - best found: {dict(Counter(r['auto'] - r['opt'] for r in rows if not r['proven']))})"
    )
    print(
        f"leaves per instance: {min(r['leaves'] for r in rows)}-{max(r['leaves'] for r in rows)}; "
        f"total {time.perf_counter() - t_start:.1f}s"
    )
    return dict(rows=rows)


def hard(seeds: int, node_limit: int, ms: float = 10.0) -> dict:
    from treepack.service.planner import repair  # noqa: PLC0415

    rows = []
    t_start = time.perf_counter()
    for family in HARD_FAMILIES:
        for size in (0, 1) if family == "grpo" else (0, 1, 2):
            for seed in range(seeds):
                kw = hard_instance(family, seed, size)
                batch = normalize_batch(
                    kw["sequences"], seq_len=kw["seq_len"], trainable=kw["trainable"], groups=kw["groups"]
                )
                tree = build_tree(batch, kw["min_shared_len"])
                C = kw["seq_len"]
                bound = lower_bound_rows(tree, C)
                rec = dict(
                    family=family,
                    size=size,
                    seed=seed,
                    leaves=len(kw["sequences"]),
                    bound=bound,
                    bfd=place_leaves(tree, batch, C, "bfd").num_rows,
                    auto_budget_ms=ms,
                )
                levels = getattr(repair, "LEVELS", ())
                for label, budget, lv in (
                    ("auto", ms, levels),
                    ("auto1000", 1000.0, levels),
                    ("narrow1000", 1000.0, tuple(x for x in levels if _near(x))),
                ):
                    saved = levels
                    if levels:
                        repair.LEVELS = lv
                    t = time.thread_time()
                    rec[label] = place_leaves(tree, batch, C, "auto", bound=bound, repair_ms=budget).num_rows
                    rec[label + "_ms"] = (time.thread_time() - t) * 1e3
                    if levels:
                        repair.LEVELS = saved
                best = min(rec["auto"], rec["auto1000"], rec["narrow1000"])
                rec["opt"], rec["proven"] = exact_min_rows(tree, C, bound, best, node_limit=node_limit)
                rows.append(rec)
    print(
        f"{'class':9s} {'n':>3s} {'leaves':>7s} {'proven':>6s} {'auto=opt':>8s} {'auto 1s=opt':>11s} "
        f"{'narrow 1s=opt':>13s} {'bfd=opt':>7s} {'bound=opt':>9s} {'auto>bfd':>8s} "
        f"{'auto CPU ms':>12s} {'auto 1s CPU ms':>14s}"
    )
    keys = sorted({(r["family"], r["size"]) for r in rows}, key=lambda k: (HARD_FAMILIES.index(k[0]), k[1]))
    for key in keys + [("all", -1)]:
        g = [r for r in rows if key[0] == "all" or (r["family"], r["size"]) == key]
        p = [r for r in g if r["proven"]]
        n_opt = lambda k: sum(r[k] == r["opt"] for r in p)  # noqa: E731
        ms = lambda k: f"{np.median([r[k + '_ms'] for r in g]):5.1f}/{max(r[k + '_ms'] for r in g):6.1f}"  # noqa: E731
        name = "all" if key[0] == "all" else f"{key[0]}-{key[1]}"
        lv = f"{min(r['leaves'] for r in g)}-{max(r['leaves'] for r in g)}"
        print(
            f"{name:9s} {len(g):3d} {lv:>7s} {len(p):6d} {n_opt('auto'):8d} {n_opt('auto1000'):11d} "
            f"{n_opt('narrow1000'):13d} {n_opt('bfd'):7d} {n_opt('bound'):9d} "
            f"{sum(r['auto'] > r['bfd'] or r['auto1000'] > r['bfd'] for r in g):8d} "
            f"{ms('auto'):>12s} {ms('auto1000'):>14s}"
        )
    print(f"total {time.perf_counter() - t_start:.1f}s")
    return dict(rows=rows)


def _near(level: tuple) -> bool:
    """A level of 12-row neighbourhoods of light rows (``("near", ...)``; before the level
    kinds, ``(size, ...)`` with size at most ``MAX_ROWS``)."""
    from treepack.service.planner import repair  # noqa: PLC0415

    return level[0] == "near" or (isinstance(level[0], int) and level[0] <= repair.MAX_ROWS)


def _key(rec: dict) -> tuple:
    return ("hard", rec["family"], rec["size"], rec["seed"]) if "seed" in rec else ("quality", rec["index"])


def best(paths: list[str]) -> dict:
    """Rows of each run (``--json`` outputs of ``quality`` and ``hard``, before and after a
    change) against the best known: per instance, the fewest rows any search of any run found
    (``auto`` at 10 ms and 1 s, ``narrow``, the exact branch and bound)."""
    runs = {p: {_key(r): r for r in json.load(open(p))["rows"]} for p in paths}
    known: dict[tuple, int] = {}
    for recs in runs.values():
        for k, r in recs.items():
            found = min(r[x] for x in ("auto", "auto1000", "narrow1000", "opt") if x in r)
            known[k] = min(known.get(k, found), found)
    out = []
    print(
        f"{'run':40s} {'set':8s} {'n':>4s} {'best known':>10s} {'auto 10ms':>9s} {'above':>5s} "
        f"{'below':>5s} {'auto 1s':>7s} {'above':>5s} {'bfd':>5s} {'auto>bfd':>8s}"
    )
    for p, recs in runs.items():
        for kind in sorted({k[0] for k in recs}):
            ks = [k for k in recs if k[0] == kind]
            row = dict(run=p, set=kind, n=len(ks), best=sum(known[k] for k in ks))
            for label in ("auto", "auto1000"):
                row[label] = sum(recs[k][label] for k in ks)
                row[label + "_above"] = [k for k in ks if recs[k][label] > known[k]]
            row["below"] = [k for k in ks if recs[k]["auto"] < known[k]]
            row["bfd"] = sum(recs[k]["bfd"] for k in ks)
            row["auto>bfd"] = sum(recs[k]["auto"] > recs[k]["bfd"] for k in ks)
            out.append(row)
            print(
                f"{p[-40:]:40s} {kind:8s} {row['n']:4d} {row['best']:10d} {row['auto']:9d} "
                f"{len(row['auto_above']):5d} {len(row['below']):5d} {row['auto1000']:7d} "
                f"{len(row['auto1000_above']):5d} {row['bfd']:5d} {row['auto>bfd']:8d}"
            )
            budgets = sorted({recs[k].get("auto_budget_ms", 10.0) for k in ks})
            row["auto_budget_ms"] = budgets
            if budgets != [10.0]:
                print(f"    ('auto 10ms' is auto at {', '.join(f'{b:g}' for b in budgets)} ms in this run)")
            for k in row["auto_above"]:
                print(
                    f"    above at {recs[k].get('auto_budget_ms', 10.0):g} ms: {k} {recs[k]['auto']} > {known[k]} "
                    f"({recs[k].get('auto_ms', 0):.1f} CPU ms)"
                )
    return dict(best=out)


def budget(repeats: int) -> dict:
    out = []
    print(
        f"{'workload':18s} {'budget':>6s} {'rows':>5s} {'bound':>5s} "
        f"{'plan CPU ms (median, min-max)':>30s} {'repair ms':>9s}"
    )
    for w in (W.curriculum(768), W.agentic(256), W.distillation(512), W.golden_example()):
        batch = normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups)
        for ms in (10.0, 1000.0):
            cpu, rep = [], []
            for _ in range(repeats):
                t = time.thread_time()
                plan = plan_normalized(batch, seq_len=w.seq_len, placement="auto", repair_ms=ms)
                cpu.append((time.thread_time() - t) * 1e3)
                rep.append(plan.stats.timings_ms["repair"])
            rec = dict(
                workload=w.name,
                budget=ms,
                rows=plan.num_rows,
                bound=plan.stats.lower_bound_rows,
                cpu_ms=cpu,
                repair_ms=rep,
            )
            out.append(rec)
            print(
                f"{w.name:18s} {ms:6.0f} {plan.num_rows:5d} {rec['bound']:5d} "
                f"{np.median(cpu):14.1f} ({min(cpu):.1f}-{max(cpu):.1f}) {np.median(rep):9.1f}",
                flush=True,
            )
    return dict(budget=out)


def scaling(groups: list[int]) -> dict:
    out = []
    for n in groups:
        t = time.perf_counter()
        w = W.curriculum(n)
        batch = normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups)
        print(
            f"[curriculum-{n}] {len(w.sequences):,} completions, {w.num_tokens:,} tokens, "
            f"generated in {time.perf_counter() - t:.1f}s",
            flush=True,
        )
        del w
        rec = {"groups": n, "completions": batch.num_sequences}
        for placement in ("bfd", "auto"):
            plan = plan_normalized(batch, seq_len=131072, placement=placement)
            tm = plan.stats.timings_ms
            rec[placement] = dict(rows=plan.num_rows, bound=plan.stats.lower_bound_rows, strategy=plan.strategy, **tm)
            print(
                f"  {placement:5s} rows {plan.num_rows:5d} (bound {plan.stats.lower_bound_rows}, {plan.strategy})  "
                + "  ".join(f"{k} {v:8.1f}" for k, v in tm.items()),
                flush=True,
            )
            del plan
        a, b = rec["auto"], rec["bfd"]
        rec["auto_over_bfd_placement"] = a["placement"] / b["placement"]
        rec["auto_plan_over_tree"] = a["total"] / a["tree"]
        print(
            f"  auto placement / bfd placement = {rec['auto_over_bfd_placement']:.2f}; "
            f"auto plan_batch / its tree build = {rec['auto_plan_over_tree']:.2f}",
            flush=True,
        )
        out.append(rec)
        del batch
    return dict(runs=out)


ATTN_BLOCK = 128  # FlexAttention's block size
GDN_CHUNK = 64  # flash-linear-attention's chunk size for the chunked delta rule


def trainer_cost(seg, seq_len: int) -> dict:
    """The trainer-side cost proxy of a plan's segments (SPEC sections 3, 5, 7).

    - ``attn_blocks``: the (query block, key block) pairs of 128 x 128 that hold at least one
      allowed pair of the mask contract (``j <= i < subtree_end[j]``), padding's diagonal
      included: the blocks a FlexAttention BlockMask computes.
    - ``gdn_chunk_tokens``: ``64 * sum over segments of ceil(len / 64)``: each segment is its
      own varlen sequence in the chunked delta rule of its depth level, so its last chunk
      is computed whole (a replay of a partial chunk per segment).
    """
    B = ATTN_BLOCK
    nb = -(-seq_len // B)
    blocks = 0
    for r in range(int(seg.row_ptr.shape[0]) - 1):
        g = np.arange(seg.row_ptr[r], seg.row_ptr[r + 1])
        start, length, end = seg.row_start[g], seg.length[g], seg.subtree_end[g]
        used = int(seg.row_len[r])
        # Pieces: a segment's keys inside one key block attend queries [first key, subtree_end).
        kb_lo, kb_hi = start // B, (start + np.maximum(length, 1) - 1) // B
        n = np.where(length > 0, kb_hi - kb_lo + 1, 0)
        kb = np.repeat(kb_lo, n) + _ragged(n)
        first = np.maximum(np.repeat(start, n), kb * B)
        q_lo, q_hi = first // B, (np.repeat(end, n) - 1) // B
        pad = np.arange(used // B, nb)  # padding: each pad key attends only itself
        kb, q_lo, q_hi = np.r_[kb, pad], np.r_[q_lo, pad], np.r_[q_hi, pad]
        diff = np.zeros((nb, nb + 1), dtype=np.int32)
        np.add.at(diff, (kb, q_lo), 1)
        np.add.at(diff, (kb, q_hi + 1), -1)
        blocks += int((np.cumsum(diff, axis=1)[:, :nb] > 0).sum())
    chunks = int((-(-seg.length[seg.length > 0] // GDN_CHUNK)).sum())
    return dict(attn_blocks=blocks, gdn_chunk_tokens=chunks * GDN_CHUNK)


def _ragged(n: np.ndarray) -> np.ndarray:
    total = int(n.sum())
    return np.arange(total) - np.repeat(np.cumsum(n) - n, n)


def short_question_grpo(num_groups: int = 512, *, seed: int = 0, seq_len: int = 32768, answer: int = 300) -> W.Workload:
    """GRPO on short questions: one 256-token system prompt, a question per group
    (log-normal, median 40 tokens, clipped to [8, 200]: mostly under ``min_shared_len``),
    8 completions per group (log-normal, median ``answer`` tokens)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, W.VOCAB, 256, dtype=np.uint32)
    seqs, trainable, groups = [], [], []
    for g in range(num_groups):
        q = W._distinct_tokens(rng, int(W._lognormal_int(rng, 40, 0.7, 8, 200, 1)[0]), g % W.VOCAB)
        prompt = np.concatenate([system, q])
        for c in W._lognormal_int(rng, answer, 0.8, 8, 4000, 8):
            seqs.append(np.concatenate([prompt, rng.integers(0, W.VOCAB, int(c), dtype=np.uint32)]))
            trainable.append(prompt.shape[0])
            groups.append(g)
    return W.Workload(
        name=f"shortq-{num_groups}-answer{answer}", sequences=seqs, trainable=trainable, groups=groups, seq_len=seq_len
    )


SHARING_RULES = (
    ("min_shared_len=64 (default)", 64, 0),
    ("min_shared_len=16", 16, 0),
    ("min_shared_len=1", 1, 0),
    ("saving >= 32", 64, 32),
    ("saving >= 64", 64, 64),
    ("saving >= 128", 64, 128),
    ("saving >= 512", 64, 512),
)


def sharing() -> dict:
    from treepack.service.planner.layout import layout_rows  # noqa: PLC0415

    out = []
    for w in (W.curriculum(768), short_question_grpo(512), short_question_grpo(512, answer=64)):
        batch = normalize_batch(w.sequences, seq_len=w.seq_len, trainable=w.trainable, groups=w.groups)
        print(f"[{w.name}] {batch.num_sequences:,} sequences, {int(batch.lens.sum()):,} tokens, C = {w.seq_len:,}")
        unpacked = int(batch.lens.sum())
        print(
            f"  {'rule':28s} {'rows':>5s} {'bound':>5s} {'tree tokens':>12s} {'saved':>6s} {'packed':>12s} "
            f"{'segments':>9s} {'attn blocks':>11s} {'GDN chunk tok':>13s}"
        )
        for label, msl, saving in SHARING_RULES:
            tree = build_tree(batch, msl, min_shared_saving=saving)
            placed = place_leaves(tree, batch, w.seq_len, "auto")
            seg = layout_rows(tree, placed.row_of, placed.num_rows)
            cost = trainer_cost(seg, w.seq_len)
            rec = dict(
                workload=w.name,
                rule=label,
                rows=placed.num_rows,
                bound=lower_bound_rows(tree, w.seq_len),
                tree_tokens=tree.num_tokens,
                packed=int(seg.row_len.sum()),
                segments=int(seg.num_segments),
                **cost,
            )
            out.append(rec)
            print(
                f"  {label:28s} {rec['rows']:5d} {rec['bound']:5d} {rec['tree_tokens']:12,} "
                f"{1 - rec['tree_tokens'] / unpacked:6.1%} {rec['packed']:12,} {rec['segments']:9,} "
                f"{rec['attn_blocks']:11,} {rec['gdn_chunk_tokens']:13,}",
                flush=True,
            )
    return dict(sharing=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    q = sub.add_parser("quality")
    q.add_argument("--per-family", type=int, default=36)
    q.add_argument("--node-limit", type=int, default=50_000)
    q.add_argument("--ms", type=float, default=10.0, help="auto's repair budget in the 'auto' column (default 10)")
    s = sub.add_parser("scaling")
    s.add_argument("--groups", type=int, nargs="+", default=[3072, 7680, 30720])
    sub.add_parser("sharing")
    b = sub.add_parser("budget")
    b.add_argument("--repeats", type=int, default=3)
    h = sub.add_parser("hard")
    h.add_argument("--seeds", type=int, default=16)
    h.add_argument("--node-limit", type=int, default=50_000)
    h.add_argument("--ms", type=float, default=10.0, help="auto's repair budget in the 'auto' column (default 10)")
    k = sub.add_parser("best")
    k.add_argument("paths", nargs="+", help="--json outputs of quality and hard runs")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {platform.processor() or platform.machine()}  "
        f"python {platform.python_version()}  {' '.join(sys.argv)}"
    )
    if args.what == "quality":
        res = quality(args.per_family, args.node_limit, args.ms)
    elif args.what == "scaling":
        res = scaling(args.groups)
    elif args.what == "budget":
        res = budget(args.repeats)
    elif args.what == "hard":
        res = hard(args.seeds, args.node_limit, args.ms)
    elif args.what == "best":
        res = best(args.paths)
    else:
        res = sharing()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
