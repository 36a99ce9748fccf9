"""matmulbench.py as a user runs it (`--quick`): random weights of the default model's shapes, no checkpoint."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest

from nanoserve.model import blockdot

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
LAYER_MB = 30 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) * 4 / 1e6  # by hand: 424.7 MB
HEAD_MB = 49152 * 576 * 4 / 1e6  # 113.2 MB


def test_quick_run_writes_one_row_per_part_and_row_count(tmp_path):
    out = tmp_path / "mm.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "matmulbench.py"), "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out}" in proc.stdout
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["part"], int(r["rows"])) for r in rows] == [("layers", 1), ("layers", 16), ("head", 1), ("head", 16)]
    for r in rows:
        mb = LAYER_MB if r["part"] == "layers" else HEAD_MB
        packed_s = float(r["packed_ms"]) / 1e3
        assert float(r["packed_gb_per_s"]) == pytest.approx(mb / 1e3 / packed_s, rel=1e-3)
        assert float(r["packed_gflop_per_s"]) == pytest.approx(2 * int(r["rows"]) * mb / 4 / 1e3 / packed_s, rel=1e-3)
        for name in ("linear", "skinny", "xWt"):
            # the CSV holds 6 significant digits of each figure
            assert float(r[f"{name}_over_packed"]) == pytest.approx(float(r[f"{name}_ms"]) / float(r["packed_ms"]), rel=1e-5)


def test_quant_run_times_the_kernels_against_dense_bf16(tmp_path):
    out = tmp_path / "mmq.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "matmulbench.py"), "--quant", "--rows", "1", "9",
                           "--rounds", "1", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    with out.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["part"], int(r["rows"])) for r in rows] == [("layers", 1), ("layers", 9), ("head", 1), ("head", 9)]
    for r in rows:
        assert (r["activations"], r["blockdot_build"]) == ("bfloat16", "native")
        assert ("blockdot_ms" in r) == (blockdot.library() is not None)  # left out only where it does not build
        for name in ("int8", "int4") + (("blockdot",) if blockdot.library() is not None else ()):
            # The CSV keeps 6 decimals: the ratio of two rounded figures agrees to 1e-4, not to the last digit.
            assert float(r[f"{name}_over_dense"]) == pytest.approx(float(r[f"{name}_ms"]) / float(r["dense_ms"]), rel=1e-4)
