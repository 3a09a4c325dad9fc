"""A newcomer's first hour, as a process: a fresh clone runs every command the README prints.

The clone is ``git clone`` of this checkout's committed HEAD (uncommitted changes are not
in it). Every command of the README's ``bash`` blocks runs in the order printed, in the
clone, except those in :data:`NOT_RUN_HERE`, each with the reason and where it is checked
instead. Then the wheel: ``make dist`` builds the sdist and wheel, a fresh venv installs
the wheel (planner only) and runs the demo and a plan from it. Under CI (``CI`` set) the
wheel part is skipped: ``.ci/run`` runs ``make wheel-check`` beside the tests, which builds
the same wheel and runs the same demo and plan from it in a fresh venv, with the trainer
extra. pip's cache is the user's, so installs reuse it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: README commands this check does not run, and why (where each is checked instead).
NOT_RUN_HERE = {
    "make test": "the suite this check is part of",
    "git clone <this repository> treepack && cd treepack": "the clone this check itself makes",
    'pip install ".[trainer,trl]"': "the wheel install below (planner only) and make wheel-check in CI (trainer extra)",
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": "make wheel-check installs torch as told",
}


def readme_commands(text: str) -> list[str]:
    """The commands of the README's ``bash`` blocks, in order, comments and continuation lines dropped."""
    cmds: list[str] = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.M | re.S):
        for line in block.splitlines():
            cmd = re.sub(r"\s+#.*$", "", line).strip()
            if cmd and not cmd.startswith("#"):
                cmds.append(cmd)
    return cmds


def test_readme_commands_are_parsed_in_order():
    cmds = readme_commands((ROOT / "README.md").read_text())
    assert cmds[:2] == ["make demo", "make test"], cmds
    assert readme_commands("```bash\nmake a   # x\n          # more of x\nb \\\n```\n```text\nc\n```\n") == [
        "make a",
        "b \\",
    ]


def _run(cmd: str, cwd: Path, timeout: float) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(["bash", "-c", cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def clone(tmp_path_factory):
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("the newcomer check needs git and make on PATH")
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout (an sdist, say): there is nothing to clone")
    dest = tmp_path_factory.mktemp("newcomer") / "clone"  # not "treepack": a cwd holding that would shadow the install
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, timeout=120)
    return dest


def test_a_fresh_clone_runs_the_readme_commands(clone):
    cmds = readme_commands((clone / "README.md").read_text())
    run = [c for c in cmds if c not in NOT_RUN_HERE]
    assert set(NOT_RUN_HERE) <= set(cmds), f"not in the README any more: {set(NOT_RUN_HERE) - set(cmds)}"
    out = {c: _run(c, clone, timeout=300) for c in run}  # in the README's order

    demo = out["make demo"]
    assert "fewer rows" in demo and ".venv/bin/treepack" in demo  # the table, then how to go on
    assert all(c.split()[0] in ("make", ".venv/bin/pip", ".venv/bin/treepack") for c in run), run
    assert (clone / "rows.png").stat().st_size > 10_000 and (clone / "rows-curriculum.png").stat().st_size > 10_000
    planned = [o for c, o in out.items() if " plan " in c]
    assert planned and all("rows" in o and "saved %" in o for o in planned)


def test_the_wheel_installs_and_runs_in_a_fresh_venv(clone):
    if os.environ.get("CI"):
        pytest.skip("CI runs make wheel-check (.ci/run): the same wheel, demo and plan, with the trainer extra")
    _run("make dist", clone, timeout=300)
    wheels = sorted((clone / "dist").glob("treepack-*.whl"))
    assert len(wheels) == 1 and list((clone / "dist").glob("treepack-*.tar.gz"))
    venv = clone.parent / "wheel-venv"
    _run(f"python3 -m venv {venv}", clone.parent, timeout=120)
    _run(f"bin/python -m pip install -q --disable-pip-version-check {wheels[0]}", venv, timeout=300)
    assert "fewer rows" in _run("bin/treepack demo --groups 24", venv, timeout=120)
    assert '"rows": 2' in _run(f"bin/treepack plan {clone}/examples/batch.jsonl --seq-len 512 --json", venv, timeout=60)
    where = _run('bin/python -c "import treepack.service; print(treepack.service.__file__)"', venv, timeout=60)
    assert where.startswith(str(venv / "lib")), where  # the wheel's files, not the clone's
