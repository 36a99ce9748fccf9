"""The systems peerbench runs, and what a worker reports about one system at one point."""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from nanoserve.instruments.baseline import RunRecord, SystemRun

NANOSERVE = "nanoserve"
HF_SERIAL = "hf-generate"
HF_STATIC = "hf-static-batch"
HF_CB = "hf-continuous-batching"
LLAMA_PY = "llama-cpp-python"
LLAMA_BATCHED = "llama-batched-bench"
SYSTEMS = (NANOSERVE, HF_SERIAL, HF_STATIC, HF_CB, LLAMA_PY, LLAMA_BATCHED)
SERIAL_SYSTEMS = (HF_SERIAL, LLAMA_PY)  # one request at a time: run on the first --serial-requests


@dataclass
class Measured:
    """One system on one workload at one concurrency, as a worker reports it."""

    workload: str  # "offline" or "ragged"
    system: str  # one of SYSTEMS
    concurrency: int  # slots / batch size / sequences; 1 for serial systems
    run: SystemRun | None = None  # per-request records; None for batched-bench or a failure
    error: str = ""  # why the system could not run this point ("" when it ran)
    steps: int | None = None  # forward steps taken, where the system says
    note: str = ""  # anything a reader must know to read the row
    # batched-bench only (no per-request records): its own totals
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    wall_s: float | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _run_to_json(run: SystemRun) -> dict[str, Any]:
    return {
        "system": run.system,
        "wall_s": run.wall_s,
        "slots": run.slots,
        "records": [asdict(r) | {"token_ids": list(r.token_ids)} for r in run.records],
    }


def _run_from_json(d: dict[str, Any]) -> SystemRun:
    return SystemRun(
        system=d["system"], records=tuple(RunRecord(**r) for r in d["records"]), wall_s=d["wall_s"], slots=d["slots"]
    )


def measured_to_json(m: Measured) -> dict[str, Any]:
    """A measurement as JSON, for a worker to hand back to the parent."""
    d = asdict(m)
    d["run"] = _run_to_json(m.run) if m.run is not None else None
    return d


def measured_from_json(d: dict[str, Any]) -> Measured:
    """The measurement `measured_to_json` wrote."""
    d = dict(d)
    run = d.pop("run")
    return Measured(run=_run_from_json(run) if run is not None else None, **d)


def error_text(e: BaseException) -> str:
    """An exception as one line of at most 300 characters, for a row's error column."""
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


def log(msg: str) -> None:
    """A time-stamped progress line on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

