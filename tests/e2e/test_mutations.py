"""The project's own mutation check: planted bugs at the invariants that matter most, each
applied alone to a copy of the tree, must make the tests named for it fail.

Each :class:`Mutant` names one source line by a regex that must match exactly one line (a
line that moved or changed is reported, never silently skipped), the substring it changes
on that line, and the targeted tests that must catch it (the tests of the module's folder
that hold that invariant, kept few so the whole check stays within a few minutes). The copy
is imported as ``treepack`` through a package directory that maps the source folders the way
``pyproject.toml`` does; the unmutated copy first passes every targeted test (the control),
so a failure after the mutation is the mutation's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"proto": "proto", "service": "service", "client": "client", "trainer": "trainer_plugin"}
IGNORE = shutil.ignore_patterns(".git", ".venv*", "__pycache__", ".hypothesis", ".pytest_cache", "*.egg-info", "build")
RUN_TIMEOUT_S = 240


@dataclass(frozen=True)
class Mutant:
    """One planted bug: in ``path``, on the one line matching ``line``, ``old`` becomes ``new``."""

    name: str
    path: str
    line: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant(
        "rule 4: a run of exactly min_shared_len not shared",
        "service/planner/tree.py",
        r"^\s+if run >= min_shared_len:$",
        ">=",
        ">",
        ("tests/planner/test_boundaries.py",),
    ),
    Mutant(
        "rule 2: the join token shared",
        "proto/batch.py",
        r"np\.maximum\(ft - 1, 0\)",
        "ft - 1",
        "ft",
        ("tests/planner/test_boundaries.py",),
    ),
    Mutant(
        "lower bound: only the volume bound",
        "service/planner/bounds.py",
        r"^\s+return max\(best, leaf_children_rows\(",
        "return max(best, ",
        "return min(best, ",
        ("tests/planner/test_planner_exact.py", "-k", "auto_is_optimal"),
    ),
    Mutant(
        "lower bound: min_copies counts one token more room below each node",
        "service/planner/bounds.py",
        r"^\s+room = np\.maximum\(seq_len - end, 1\)$",
        "seq_len - end",
        "seq_len - end + 1",
        ("tests/planner/test_bounds.py",),
    ),
    Mutant(
        "lower bound: the count bound's threshold (the shortest leaf) dropped",
        "service/planner/bounds.py",
        r"^\s+ts\.append\(max\(int\(tree\.end\[leaves\]\.min\(\)\), 1\)\)",
        "ts.append(",
        "[].append(",
        ("tests/planner/test_bounds.py",),
    ),
    Mutant(
        "in_order: a row filled to seq_len closed early",
        "service/planner/baselines.py",
        r"^\s+if r < 0 or m > room:$",
        "m > room",
        "m >= room",
        ("tests/planner/test_boundaries.py",),
    ),
    Mutant(
        "bfd: groups visited smallest first",
        "service/planner/baselines.py",
        r'group_rank\[np\.argsort\(-biggest, kind="stable"\)\]',
        "np.argsort(-biggest",
        "np.argsort(biggest",
        ("tests/planner/test_planner_workloads.py", "-k", "fast_bfd_equals_naive"),
    ),
    Mutant(
        "validate_plan off",
        "service/planner/invariant.py",
        r"^\s+raise PlanInvariantError\(what\)$",
        "raise PlanInvariantError(what)",
        "return None",
        ("tests/planner/test_validate_forged.py",),
    ),
    Mutant(
        "validate_plan: empty segments allowed",
        "service/planner/validate_rows.py",
        r'"empty segment in a row"\)$',
        "np.all(seg.length >= 1)",
        "np.all(seg.length >= 0)",
        ("tests/planner/test_validate_forged.py",),
    ),
    Mutant(
        "validate_plan: sharers not checked",
        "service/planner/validate_rows.py",
        r'"sharers count mismatch"\)$',
        "np.array_equal(sharers, seg.sharers)",
        "True",
        ("tests/planner/test_validate_forged.py",),
    ),
    Mutant(
        "validate_plan: GDN parent slots not checked",
        "service/planner/validate_metadata.py",
        r'f"GDN parent slots of level \{d\}"\)$',
        "np.array_equal(prev[lv.parent_slot], lv.parent)",
        "True",
        ("tests/planner/test_validate_forged.py",),
    ),
    Mutant(
        "mask: interval contract off by one (planner reference)",
        "service/planner/validate_rows.py",
        r"return \(j <= i\) & \(i < subtree_end\[None, :\]\)$",
        "(i < subtree_end",
        "(i <= subtree_end",
        ("tests/planner/test_validate_forged.py",),
    ),
    Mutant(
        "mask: dense mask off by one (trainer)",
        "trainer_plugin/kernels/masks.py",
        r"m = \(idx\[None, None, :\] <= idx\[None, :, None\]\) & \(idx\[None, :, None\] < subtree_end",
        "(idx[None, :, None] < subtree_end",
        "(idx[None, :, None] <= subtree_end",
        ("tests/trainer/test_trainer_attention.py", "-k", "dense_reference_matches_naive"),
    ),
    Mutant(
        "loss: groups with no scored token counted",
        "trainer_plugin/losses/entries.py",
        r"^\s+nz = \(ng > 0\)\.sum\(\)\.clamp\(min=1\)$",
        "(ng > 0)",
        "(ng >= 0)",
        ("tests/trainer/test_trainer_losses.py", "-k", "no_scored"),
    ),
    Mutant(
        "wire: a source index equal to S decodes",
        "proto/plan_wire.py",
        r'_in\(seg\.seq, 0, s, "\$\.segments\.seq"\)$',
        "0, s,",
        "0, s + 1,",
        ("tests/proto/test_plan_structure.py",),
    ),
    Mutant(
        "wire: GDN parent slot past the previous level",
        "proto/plan_wire.py",
        r"_in\(lv\.parent_slot, -1, prev, ",
        "-1, prev,",
        "-1, prev + 1,",
        ("tests/proto/test_plan_structure.py",),
    ),
    Mutant(
        "wire: CSR end not checked",
        "proto/plan_wire.py",
        r'int\(ptr\[-1\]\) == total, f"must run from 0 to \{total\}"',
        "int(ptr[-1]) == total",
        "int(ptr[-1]) >= 0",
        ("tests/proto/test_plan_structure.py",),
    ),
    Mutant(
        "service: malformed body answered 422",
        "proto/errors.py",
        r"^\s+DecodeError: 400,$",
        "400",
        "422",
        ("tests/service/test_service_errors.py", "-k", "status"),
    ),
    Mutant(
        "refusal: attention dropout while training accepted",
        "trainer_plugin/hf/admission/attention_checks.py",
        r"if mod\.training and isinstance\(drop, \(int, float\)\) and drop > 0:$",
        "drop > 0",
        "drop > 1",
        ("tests/trainer/test_family_sweep.py", "-k", "attention_dropout"),
    ),
    Mutant(
        "TRL: keep-groups order by group id, not the draw",
        "trainer_plugin/trl/grpo.py",
        r"order = torch\.from_numpy\(perm\[np\.lexsort\(\(np\.arange\(B\), first\[g\]\)\)\]",
        "first[g]",
        "g",
        ("tests/trainer/test_trl_bridge.py", "-k", "seeded_draw"),
    ),
)


def _locate(root: Path, m: Mutant) -> tuple[list[str], int]:
    """(lines of the file, index of the one line the mutant names); fails when not exactly one."""
    lines = (root / m.path).read_text().splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if re.search(m.line, text.rstrip("\n"))]
    assert len(hits) == 1, (
        f"mutant {m.name!r}: /{m.line}/ matches {len(hits)} lines of {m.path} "
        "(the code moved or changed: update the mutant)"
    )
    assert m.old in lines[hits[0]], f"mutant {m.name!r}: {m.old!r} not on line {hits[0] + 1} of {m.path}"
    return lines, hits[0]


def test_every_mutant_names_exactly_one_line():
    for m in MUTANTS:
        _locate(ROOT, m)
    assert len({m.name for m in MUTANTS}) == len(MUTANTS)


def _pytest(copy: Path, args: tuple[str, ...]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["PYTHONPATH"] = str(copy / "_pkg")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *args]
    return subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """A copy of the tree, importable as ``treepack``, whose targeted tests pass unmutated."""
    dst = tmp_path_factory.mktemp("mutants") / "tree"
    shutil.copytree(ROOT, dst, ignore=IGNORE, symlinks=True)
    pkg = dst / "_pkg" / "treepack"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, folder in PACKAGES.items():
        (pkg / name).symlink_to(dst / folder, target_is_directory=True)
    probe = subprocess.run(
        [sys.executable, "-c", "import treepack.proto.plan as m; print(m.__file__)"],
        env={**os.environ, "PYTHONPATH": str(dst / "_pkg")},
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip().startswith(str(dst)), (
        f"the copy is not what imports: {probe.stdout} {probe.stderr[-400:]}"
    )
    # The control: the whole files of the mutants that name no -k, then the others' files
    # with the union of their selections.
    whole = sorted({m.tests[0] for m in MUTANTS if len(m.tests) == 1})
    picked = sorted({m.tests[0] for m in MUTANTS if len(m.tests) == 3})
    union = " or ".join(sorted({m.tests[2] for m in MUTANTS if len(m.tests) == 3}))
    for args in (tuple(whole), (*picked, "-k", union)):
        res = _pytest(dst, args)
        assert res.returncode == 0, (
            f"the unmutated copy fails {' '.join(args)}:\n{res.stdout[-3000:]}\n{res.stderr[-2000:]}"
        )
    return dst


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.name for m in MUTANTS])
def test_mutant_is_killed(copy, mutant):
    lines, i = _locate(copy, mutant)
    original = "".join(lines)
    lines[i] = lines[i].replace(mutant.old, mutant.new, 1)
    (copy / mutant.path).write_text("".join(lines))
    try:
        res = _pytest(copy, mutant.tests)
    finally:
        (copy / mutant.path).write_text(original)
    tail = (res.stdout[-1500:] + res.stderr[-800:]).strip()
    verdict = "killed" if res.returncode == 1 else "SURVIVED" if res.returncode == 0 else f"rc {res.returncode}"
    print(f"MUTANT | {mutant.name} | {' '.join(mutant.tests)} | {verdict}")
    assert res.returncode != 0, (
        f"mutant survived: {mutant.name} ({mutant.path}: {mutant.old!r} -> {mutant.new!r}); "
        f"{' '.join(mutant.tests)} passed:\n{tail}"
    )
    assert res.returncode == 1, (
        f"mutant {mutant.name}: pytest exited {res.returncode} (an error, not a failing test):\n{tail}"
    )
