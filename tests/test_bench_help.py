"""Every bench under benchmarks/ starts from the repository root as its docstring says, `--help` shown."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one interpreter per script, each importing torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__init__.py")


def test_the_benches_live_in_benchmarks():
    assert {"abbench.py", "cachebench.py", "curvebench.py", "matmulbench.py"} <= set(SCRIPTS)


@pytest.mark.parametrize(
    "argv",
    [[f"benchmarks/{name}"] for name in SCRIPTS] + [["-m", "benchmarks.peerbench"], ["-m", "benchmarks.peerbench.precision"],
     ["-m", "benchmarks.peerbench.depth"],
     ["quantbench.py"]],
    ids=lambda argv: argv[-1],
)
def test_help_from_the_repository_root(argv):
    proc = subprocess.run([sys.executable, *argv, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: ")
    assert "--out" in proc.stdout
