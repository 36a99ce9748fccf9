"""Running one child process: a small launcher reads the child's own peak resident memory, and a
child that runs past its time is killed with its process group."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository
WORKERS_MODULE = "benchmarks.peerbench.workers"  # run with `python -m` from ROOT


@dataclass(frozen=True)
class ChildResult:
    """What one subprocess left behind: its JSON result, its peak resident memory, and how it ended."""

    result: Any  # parsed JSON, or None when the child died
    peak_rss_mib: float  # ru_maxrss of that child alone (wait4 in a small launcher), MiB; nan if killed
    seconds: float  # wall time of the whole child, start-up and model load included
    error: str  # "" when it exited 0


# A child's ru_maxrss is not its own when a large process starts it: execve keeps the high-water
# mark of the memory it replaces, and Popen's vfork hands the child the parent's (a pytest or bench
# process holding a model reads as 2.5 GB for a child that used 300 MB). So a small launcher, whose
# own memory is a fresh interpreter's, starts the command and reports that grandchild's wait4 rusage.
_LAUNCHER = (
    "import os, sys\n"
    "pid = os.posix_spawnp(sys.argv[2], sys.argv[2:], os.environ)\n"
    "_, status, usage = os.wait4(pid, 0)\n"
    "open(sys.argv[1], 'w').write(str(usage.ru_maxrss))\n"
    "sys.exit(os.waitstatus_to_exitcode(status))\n"
)


def run_child(cmd: list[str], timeout_s: float, result_path: Path | None, cwd: Path | None = None) -> ChildResult:
    """Run one child to completion (or kill its process group at the timeout) and read its own peak RSS.

    The child's JSON result is read from `result_path`; with None, the result is its stdout.
    """
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(prefix="peerbench-rss-", delete=False) as f:
        rss_path = Path(f.name)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(rss_path), *cmd],
            stdout=subprocess.PIPE if result_path is None else None, text=True, start_new_session=True, cwd=cwd,
        )
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            stdout, _ = proc.communicate()
        text = rss_path.read_text().strip()
    finally:
        rss_path.unlink(missing_ok=True)
    seconds = time.perf_counter() - start
    peak = int(text) / 1024 if text else math.nan  # Linux reports KiB; nothing when it was killed
    stdout = stdout or ""
    if proc.returncode != 0:
        why = "timed out" if seconds > timeout_s else f"exit {proc.returncode}"
        return ChildResult(result=stdout or None, peak_rss_mib=peak, seconds=seconds, error=why)
    if result_path is None:
        return ChildResult(result=stdout, peak_rss_mib=peak, seconds=seconds, error="")
    return ChildResult(result=json.loads(result_path.read_text()), peak_rss_mib=peak, seconds=seconds, error="")


def run_worker(kind: str, task: dict[str, Any], tmp: Path, timeout_s: float) -> ChildResult:
    """Run `kind` in a fresh `python -m benchmarks.peerbench.workers` subprocess, cwd the repository."""
    path = tmp / f"{kind}.json"
    path.write_text(json.dumps(task | {"kind": kind}))
    out = Path(str(path) + ".out.json")
    out.unlink(missing_ok=True)
    return run_child([sys.executable, "-m", WORKERS_MODULE, str(path)], timeout_s, out, cwd=ROOT)

