"""The three root bench scripts, run as a user runs them: `python X.py --quick --out ...` on real weights.

Each run is about a minute on a 2-core CPU, so the file is marked slow as well as weights. The
checks are on the CSV each script writes (columns with units, one row per measurement) and on
the relations between its columns that hold by construction, plus the refusals a CPU must print.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_default_model

from nanoserve.profiler import FORWARD, PHASES

pytestmark = [pytest.mark.weights, pytest.mark.slow, requires_default_model]

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600  # a generous ceiling on a shared box; a quick run is about a minute


def run_script(name: str, *args: str) -> str:
    """Runs ROOT/name with args; returns stdout. Fails the test on a non-zero exit."""
    script = ROOT / name
    if not script.is_file():
        pytest.fail(f"{name} does not exist at {script}")
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc.stdout


def read_csv(path: Path) -> list[dict[str, str]]:
    assert path.is_file(), f"{path} was not written"
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


PROFBENCH_COLUMNS = {
    "slots", "requests", "output_tokens", "decode_steps", "step_ms", "forward_ms", "loop_ms",
    "loop_per_token_ms", "loop_share_pct", "schedule_ms", "sync_rows_ms", "build_inputs_ms", "sample_ms",
    "collect_ms", "accounted_pct", "overlap_model", "device_timed", "projected_forward_ms",
    "projected_step_ms", "null_recorder_us_per_step", "step_recorder_us_per_step",
}


def test_profbench_quick(tmp_path):
    out = tmp_path / "profbench.csv"
    stdout = run_script("profbench.py", "--quick", "--out", str(out))
    rows = read_csv(out)
    assert set(rows[0]) >= PROFBENCH_COLUMNS
    assert [int(r["slots"]) for r in rows] == [1, 2, 4]  # --quick's slot counts, one row each
    for r in rows:
        slots = int(r["slots"])
        assert int(r["requests"]) == slots
        # 12 tokens per request: 1 prefill step + 11 decode steps = 12 steps, 2 dropped as warm-up.
        assert int(r["output_tokens"]) == 12
        assert int(r["decode_steps"]) == 10
        loop = sum(float(r[f"{name}_ms"]) for name in PHASES if name != FORWARD)
        assert float(r["loop_ms"]) == pytest.approx(loop, abs=1e-5)  # the loop is every phase but forward
        assert float(r["loop_per_token_ms"]) == pytest.approx(float(r["loop_ms"]) / slots, abs=1e-5)
        assert float(r["loop_share_pct"]) == pytest.approx(100 * float(r["loop_ms"]) / float(r["step_ms"]),
                                                           abs=1e-4)
        assert float(r["forward_ms"]) < float(r["step_ms"])
        assert 98.0 <= float(r["accounted_pct"]) <= 100.0  # check_accounted's 2% tolerance
        assert r["overlap_model"] == "serial"  # collect reads back every step
        assert r["device_timed"] == "False"  # a CPU has no second clock
        # the projection is the measured loop under the substituted forward (serial: loop + forward)
        assert float(r["projected_step_ms"]) == pytest.approx(float(r["projected_forward_ms"]) + loop, abs=1e-5)
        assert 0.0 < float(r["null_recorder_us_per_step"]) < float(r["step_recorder_us_per_step"])
    assert "loop/token" in stdout and "loop share" in stdout  # render_sweep's table
    assert stdout.count("check_device_timed refuses") == 3  # one refusal per slot count on a CPU


SYNCBENCH_COLUMNS = {
    "slots", "params", "per_row_ms", "one_tensor_ms", "speedup_x", "syncs_before", "syncs_after",
    "engine_transfers_per_step", "engine_readback_journeys", "engine_steps", "engine_sample_ms",
    "engine_collect_ms", "per_transfer_us", "sync_saving_per_step_ms", "sync_saving_priced",
}


def test_syncbench_quick(tmp_path):
    out = tmp_path / "syncbench.csv"
    stdout = run_script("syncbench.py", "--quick", "--slots", "1", "2", "4", "--out", str(out))
    rows = read_csv(out)
    assert set(rows[0]) >= SYNCBENCH_COLUMNS
    # one row per slot count and parameter set, in that order
    assert [(int(r["slots"]), r["params"]) for r in rows] == [
        (s, p) for s in (1, 2, 4) for p in ("greedy", "top-p")
    ]
    for r in rows:
        slots = int(r["slots"])
        # Counted live: greedy rows were one gather + one .tolist(); each top-p row its own int().
        assert int(r["syncs_before"]) == (1 if r["params"] == "greedy" else slots)
        assert int(r["syncs_after"]) == 1
        assert float(r["speedup_x"]) == pytest.approx(float(r["per_row_ms"]) / float(r["one_tensor_ms"]),
                                                      rel=1e-4)
        # 8 tokens per live request (--quick): 8 steps, one journey each.
        assert float(r["engine_transfers_per_step"]) == 1.0
        assert int(r["engine_readback_journeys"]) == int(r["engine_steps"]) == 8
        assert r["sync_saving_priced"] == "False" and r["sync_saving_per_step_ms"] == ""
    assert "syncs before/after" in stdout  # output.render's table
    assert "check_measurable refuses" in stdout


def test_hfbench_quick(tmp_path):
    out = tmp_path / "hfbench.csv"
    run_script("hfbench.py", "--quick", "--out", str(out))
    rows = read_csv(out)
    assert len(rows) >= 1
    throughput = [c for c in rows[0] if c == "tokens_per_s" or c.endswith(("_tok_s", "_tok_per_s"))]
    assert throughput, f"no throughput column in {list(rows[0])}"
    for r in rows:
        assert all(float(r[c]) > 0.0 for c in throughput)
    # The baseline and the engine at each --quick slot count, paired: a row exists only because
    # compare() found every request's token ids equal to transformers' (it refuses otherwise, and
    # run_script fails on the non-zero exit), so each row did the same 4 x 12 tokens.
    assert [(r["system"], int(r["slots"])) for r in rows] == [
        ("hf-generate", 1), ("nanoserve, 1", 1), ("nanoserve, 2", 2), ("nanoserve, 4", 4)]
    assert all((int(r["requests"]), int(r["output_tokens"])) == (4, 4 * 12) for r in rows)
    assert float(rows[0]["speedup_x"]) == 1.0  # the baseline against itself
