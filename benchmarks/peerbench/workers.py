"""Entry point of a worker subprocess (`python -m benchmarks.peerbench.workers TASK.json`, cwd the
repository): one system, every point of its task, the result written beside the task. nanoserve's
worker lives here; the peers' in hf.py and llamacpp.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.peerbench.hf import worker_hf_cb, worker_hf_serial, worker_hf_static
from benchmarks.peerbench.limits import measure_limits
from benchmarks.peerbench.llamacpp import worker_llama_py
from benchmarks.peerbench.measured import (
    HF_CB,
    HF_SERIAL,
    HF_STATIC,
    LLAMA_PY,
    NANOSERVE,
    Measured,
    error_text,
    log,
    measured_to_json,
)


def worker_nanoserve(task: dict[str, Any]) -> list[Measured]:
    """nanoserve at every slot count on every workload, a fresh Engine per point over one loaded model."""
    from nanoserve import Engine, EngineConfig
    from nanoserve.instruments.baseline import check_concurrent
    from nanoserve.instruments.runners import run_concurrent
    from nanoserve.model.kv_cache import bytes_per_block

    max_len = task["max_model_len"]
    block = EngineConfig().block_size
    one_request = -(-max_len // block)  # the loading engine's KV pool: one request, not the 512 MiB default
    base = Engine.from_pretrained(None, EngineConfig(dtype="float32", quantization=None, max_model_len=max_len, num_kv_blocks=one_request))
    model, tok = base.model, base.tokenizer
    del base
    per_block = bytes_per_block(model.config, block, model.dtype)
    out = []
    first = True
    for name, wl in task["workloads"].items():
        longest = max(len(p) + n for p, n in zip(wl["prompts"], wl["output_lens"], strict=True))
        if first:  # warm-up, uncounted: allocation and kernel selection
            warm = EngineConfig(dtype="float32", quantization=None, max_model_len=max_len, max_num_seqs=2, num_kv_blocks=2 * one_request)
            run_concurrent(Engine(model, tok, warm), wl["prompts"][:2], 4)
            first = False
        for slots in task["slots"]:
            # One slot serves one request at a time: like the serial peers it runs the first
            # serial_requests (the rate of a serial run does not depend on how many it runs).
            k = min(task["serial_requests"], len(wl["prompts"])) if slots == 1 else len(wl["prompts"])
            prompts, lens = wl["prompts"][:k], wl["output_lens"][:k]
            # Enough KV blocks that every slot can hold the longest request: no preemption.
            blocks = min(slots, len(prompts)) * (-(-longest // block)) + slots
            config = EngineConfig(dtype="float32", quantization=None, max_num_seqs=slots, max_model_len=max_len, num_kv_blocks=blocks)
            log(f"nanoserve {name} slots={slots}")
            m = Measured(workload=name, system=NANOSERVE, concurrency=slots)
            if k < len(wl["prompts"]):
                m.note = f"one slot: the first {k} requests, as the serial peers"
            try:
                engine = Engine(model, tok, config)
                run = run_concurrent(engine, prompts, lens, system=NANOSERVE)
                if slots > 1 and len(prompts) > 1:
                    check_concurrent(run)
                m.run, m.steps = run, engine.num_steps
                m.extra = {"kv_cache_mib": blocks * per_block / 2**20}
            except Exception as e:  # a point that fails is a row saying why, not a lost run
                m.error = error_text(e)
            out.append(m)
    return out


WORKERS = {
    NANOSERVE: worker_nanoserve,
    HF_SERIAL: worker_hf_serial,
    HF_STATIC: worker_hf_static,
    HF_CB: worker_hf_cb,
    LLAMA_PY: worker_llama_py,
}


def worker_main(task_path: str) -> None:
    """Read the task at `task_path`, run it, and write its JSON result to `task_path`.out.json."""
    import torch

    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(task["threads"])
    kind = task["kind"]
    if kind == "limits":
        result: Any = measure_limits(task["gemm_n"], task["copy_mib"])
    else:
        result = [measured_to_json(m) for m in WORKERS[kind](task)]
    Path(task_path + ".out.json").write_text(json.dumps(result))


if __name__ == "__main__":
    worker_main(sys.argv[1])
