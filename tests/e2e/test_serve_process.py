"""``python -m treepack.service`` and the uvicorn worker factory as processes: entry point, lazy imports, allocator."""

from __future__ import annotations

import os
import subprocess
import sys


def test_importing_the_package_loads_no_fastapi():
    code = (
        "import sys, treepack.service, treepack.service.planner, treepack.service.serve; "
        "print('fastapi' in sys.modules, 'uvicorn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_module_entry_point():
    r = subprocess.run([sys.executable, "-m", "treepack.service", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "--max-body-bytes" in r.stdout and "--token-file" in r.stdout


def test_worker_factory_keeps_freed_memory_on_glibc():
    # In a child process: mallopt is process-wide.
    code = (
        "import platform, sys\n"
        "from treepack.service.malloc import keep_freed_memory\n"
        "assert keep_freed_memory(0) is False\n"
        "assert keep_freed_memory(64 << 20) is (platform.libc_ver()[0] == 'glibc')\n"
        "from treepack.service.app import create_app_from_env\n"
        "app = create_app_from_env(); app.state.service.close()\n"
    )
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}, "TREEPACK_MALLOC_KEEP_MB": "32"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_bad_cost_file_is_one_line_and_status_2_from_the_installed_command(tmp_path):
    import shutil

    exe = shutil.which("treepack", path=os.path.dirname(sys.executable))
    assert exe is not None, "the treepack console script of this venv"
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TREEPACK_")}
    r = subprocess.run(
        [exe, "serve", "--cost-model-path", str(bad), "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"treepack serve: --cost-model-path: cost file {str(bad)!r}: not a treepack cost model: format is None, "
        "expected 'treepack-cost-model' (field $.format, rule format)"
    ]
