"""peerbench: nanoserve beside every peer on this machine, in one run, one system after another.

Same prompts (random token ids from a fixed seed), greedy, EOS ignored, fp32, the default model
(SmolLM2-135M-Instruct), on two workloads: the seeds' offline shape (every request handed over at
once, equal lengths) and a ragged one in nano-vllm's style. The systems, in the order they run:

    nanoserve                 slots 1 2 4 8 16 32 64, a fresh Engine per slot count, one loaded model
    hf-generate               transformers `generate`, one request at a time (baseline.run_serial)
    hf-static-batch           `generate` over left-padded batches of the concurrency size, in
                              workload order (vLLM's "hf" throughput backend)
    hf-continuous-batching    transformers' own paged continuous batching (ContinuousBatchingManager,
                              max_requests_per_batch = the concurrency), where it runs on this CPU
    llama-cpp-python          llama.cpp through its Python binding, one request at a time, on an
                              f32 GGUF of the same weights with an f32 KV cache (optional extra)
    llama-batched-bench       llama.cpp's own batched benchmark at the same numbers of sequences
                              (equal lengths only: on the ragged workload it runs the mean lengths)

Whatever serves one request at a time (hf-generate, llama-cpp-python, nanoserve at one slot) runs
the first --serial-requests of a workload: a serial run's rate does not depend on how many it runs,
and the ratios then compare the same requests.

Each system runs in its own subprocess of this script (`--worker`), so its peak resident memory
is its own (the kernel's rusage of that child, read through os.wait4 in a small launcher) and no allocator state
leaks from one system into the next; no two systems ever run at once. A GEMM peak (a 2048^3 fp32
matmul) and a copy bandwidth (a large tensor copy) are timed in the same run, and every row says
what fraction of them its throughput implies.

Token ids: nanoserve at every slot count must equal transformers `generate` one at a time
(`baseline.compare`; the run exits non-zero otherwise, after writing what it measured). The static
padded batch, continuous batching and llama.cpp may legitimately diverge (other shapes, other
kernels); their first divergence per request is reported in the table and, per request, in
peerbench_divergence.csv, never hidden.

    python peerbench.py                    # the full run (about 35 minutes on 2 cores)
    python peerbench.py --quick            # about 2 minutes: 8 requests, slots 1 4 8
    python peerbench.py --setup-llamacpp   # once: sdist, f32 GGUF, llama-batched-bench under .peers/

Writes OUT/peerbench.csv (units in the column names), OUT/peerbench_divergence.csv and, when
matplotlib is installed, OUT/peerbench.png (output tokens/s against concurrency, every system).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nanoserve.baseline import (
    RunRecord,
    SystemRun,
    UnfairComparison,
    compare,
    first_divergence,
)
from nanoserve.instruments.load import Workload, offline_workload, ragged_workload

ROOT = Path(__file__).resolve().parents[2]  # the repository
PEERS_DIR = ROOT / ".peers"  # listed in .git/info/exclude: sdist, GGUF and llama.cpp build live here
GGUF_NAME = "smollm2-135m-f32.gguf"
BATCHED_BENCH = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-batched-bench"
LLAMA_CPP_SDIST = "llama-cpp-python"

NANOSERVE = "nanoserve"
HF_SERIAL = "hf-generate"
HF_STATIC = "hf-static-batch"
HF_CB = "hf-continuous-batching"
LLAMA_PY = "llama-cpp-python"
LLAMA_BATCHED = "llama-batched-bench"
SYSTEMS = (NANOSERVE, HF_SERIAL, HF_STATIC, HF_CB, LLAMA_PY, LLAMA_BATCHED)
SERIAL_SYSTEMS = (HF_SERIAL, LLAMA_PY)  # one request at a time: run on the first --serial-requests


# ---- pure arithmetic (tested by hand in tests/test_peerbench.py) ---------------------------------


def gemm_flops(n: int) -> float:
    """Floating-point operations of an n x n by n x n matmul: n^3 multiply-adds, 2 n^3 flops."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    return 2.0 * n**3


def copy_traffic_bytes(nbytes: int) -> float:
    """Bytes a copy of `nbytes` moves through memory: each byte is read once and written once."""
    if nbytes < 1:
        raise ValueError(f"nbytes={nbytes} must be >= 1")
    return 2.0 * nbytes


def gemm_fraction(num_params: int, tokens_per_s: float, gemm_flop_per_s: float) -> float:
    """Fraction of the measured GEMM peak implied by a token rate: 2 x params x tokens/s / peak.

    Each token costs one multiply-add per weight in the linear layers (the tied LM head included),
    so 2 x params flops; attention's own flops are left out, which makes this a lower bound.
    """
    if num_params < 1:
        raise ValueError(f"num_params={num_params} must be >= 1")
    if tokens_per_s < 0:
        raise ValueError(f"tokens_per_s={tokens_per_s} must be >= 0")
    if not gemm_flop_per_s > 0:
        raise ValueError(f"gemm_flop_per_s={gemm_flop_per_s} must be > 0")
    return 2.0 * num_params * tokens_per_s / gemm_flop_per_s


def bandwidth_fraction(weight_bytes: int, steps_per_s: float, copy_bytes_per_s: float) -> float:
    """Fraction of the measured copy bandwidth implied by reading every weight once per forward step.

    weight bytes x steps/s / bandwidth; the KV cache and activations are left out (a lower bound).
    """
    if weight_bytes < 1:
        raise ValueError(f"weight_bytes={weight_bytes} must be >= 1")
    if steps_per_s < 0:
        raise ValueError(f"steps_per_s={steps_per_s} must be >= 0")
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s={copy_bytes_per_s} must be > 0")
    return weight_bytes * steps_per_s / copy_bytes_per_s


@dataclass(frozen=True)
class DivergenceReport:
    """Where each request's tokens first left the reference's; None where they never did."""

    splits: tuple[int | None, ...]  # per request, in workload order: first differing position

    @property
    def num_requests(self) -> int:
        """Requests compared."""
        return len(self.splits)

    @property
    def identical(self) -> int:
        """Requests whose token ids equal the reference's exactly."""
        return sum(1 for s in self.splits if s is None)

    @property
    def earliest(self) -> int | None:
        """The smallest split position over all requests, or None when every request is identical."""
        positions = [s for s in self.splits if s is not None]
        return min(positions) if positions else None

    def summary(self, limit: int = 6) -> str:
        """'8/8 identical', or '5/8 identical; split r1@17 r4@3 r6@30' listing at most `limit`."""
        head = f"{self.identical}/{self.num_requests} identical"
        split = [f"r{i}@{s}" for i, s in enumerate(self.splits) if s is not None]
        if not split:
            return head
        more = f" +{len(split) - limit} more" if len(split) > limit else ""
        return f"{head}; split {' '.join(split[:limit])}{more}"


def divergence_report(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> DivergenceReport:
    """Compare two systems' token ids request by request (`baseline.first_divergence` on each pair).

    Raises:
        ValueError: the two hold different numbers of requests.
    """
    if len(reference) != len(candidate):
        raise ValueError(f"reference has {len(reference)} requests but candidate has {len(candidate)}; need equal")
    return DivergenceReport(tuple(first_divergence(a, b) for a, b in zip(reference, candidate, strict=True)))


def static_batches(num_requests: int, batch_size: int) -> list[range]:
    """Consecutive batches of request indices in workload order, the last one possibly short."""
    if num_requests < 1:
        raise ValueError(f"num_requests={num_requests} must be >= 1")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    return [range(i, min(i + batch_size, num_requests)) for i in range(0, num_requests, batch_size)]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[list[list[int]], list[list[int]]]:
    """Left-pad prompts to the longest one: (ids [B][T], attention mask [B][T], 0 on padding)."""
    if not prompts:
        raise ValueError("left_pad needs at least 1 prompt, got 0")
    width = max(len(p) for p in prompts)
    ids = [[pad_id] * (width - len(p)) + list(p) for p in prompts]
    mask = [[0] * (width - len(p)) + [1] * len(p) for p in prompts]
    return ids, mask


def step_stamped_records(
    arrival_s: float, batch_start_s: float, stamps: Sequence[float], prompt_lens: Sequence[int],
    token_ids: Sequence[Sequence[int]],
) -> list[RunRecord]:
    """Records of one static batch whose every generation step was stamped (stamps[k] = token k).

    Request i's first token existed at stamps[0] and its last requested one at stamps[n_i - 1];
    steps after that are overshoot it waited through without wanting. It held its row from the
    batch's start, and its prompt forward ended at stamps[0].

    Raises:
        ValueError: a request wants more tokens than there are stamps, or the lists disagree in length.
    """
    if len(prompt_lens) != len(token_ids):
        raise ValueError(f"{len(prompt_lens)} prompt lengths for {len(token_ids)} outputs; need one each")
    records = []
    for plen, ids in zip(prompt_lens, token_ids, strict=True):
        if not 1 <= len(ids) <= len(stamps):
            raise ValueError(f"an output of {len(ids)} tokens needs 1..{len(stamps)} stamps")
        last = stamps[len(ids) - 1]
        records.append(
            RunRecord(
                prompt_len=plen,
                token_ids=tuple(ids),
                arrival_s=arrival_s,
                first_token_s=stamps[0],
                finished_s=last,
                served_s=last - batch_start_s,
                prefill_s=stamps[0] - batch_start_s,
            )
        )
    return records


def mean_tpot_s(run: SystemRun) -> float | None:
    """Mean over requests with > 1 token of (finish - first token) / (tokens - 1); None if none has."""
    vals = [(r.finished_s - r.first_token_s) / (r.output_len - 1) for r in run.records if r.output_len > 1]
    return math.fsum(vals) / len(vals) if vals else None


def decode_tok_per_s(run: SystemRun) -> float | None:
    """Mean over requests with > 1 token of (tokens - 1) / (finish - first token): one row's decode rate."""
    vals = [
        (r.output_len - 1) / (r.finished_s - r.first_token_s)
        for r in run.records
        if r.output_len > 1 and r.finished_s > r.first_token_s
    ]
    return math.fsum(vals) / len(vals) if vals else None


def head_of_run(run: SystemRun, k: int) -> SystemRun:
    """The first k requests of a run, with the wall clock from its first arrival to their last finish.

    For a one-slot FIFO run this is exactly how long the engine took to serve those k requests,
    which makes it comparable to a serial peer that ran only them.
    """
    if not 1 <= k <= run.num_requests:
        raise ValueError(f"k={k} must be within [1, {run.num_requests}]")
    head = run.records[:k]
    start = min(r.arrival_s for r in run.records)
    return SystemRun(system=run.system, records=head, wall_s=max(r.finished_s for r in head) - start, slots=run.slots)


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The JSONL rows of `llama-batched-bench --output-format jsonl` found in its output."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pl"' in line:
            rows.append(json.loads(line))
    return rows


def safetensors_sizes(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of a safetensors file, read from its header alone."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    params = nbytes = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        params += math.prod(info["shape"])
        start, end = info["data_offsets"]
        nbytes += end - start
    return params, nbytes


# ---- what one system measured ---------------------------------------------------------------------


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


def _measured_to_json(m: Measured) -> dict[str, Any]:
    d = asdict(m)
    d["run"] = _run_to_json(m.run) if m.run is not None else None
    return d


def _measured_from_json(d: dict[str, Any]) -> Measured:
    d = dict(d)
    run = d.pop("run")
    return Measured(run=_run_from_json(run) if run is not None else None, **d)


def _error_text(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text[:300]


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- workers: each runs inside its own subprocess ----------------------------------------------


def measure_limits(gemm_n: int, copy_mib: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` fp32 GEMM flop rate, copy bandwidth (read + write counted) and read-only
    bandwidth (a sum over the same tensor) on this machine, with the bench's threads."""
    import torch

    a = torch.randn(gemm_n, gemm_n)
    b = torch.randn(gemm_n, gemm_n)
    c = torch.empty(gemm_n, gemm_n)
    torch.mm(a, b, out=c)  # warm-up: thread pool and kernel selection
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    gemm = gemm_flops(gemm_n) / best
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    copy = copy_traffic_bytes(src.numel() * 4) / best
    src.sum()
    best = math.inf
    for _ in range(repeats):  # a read-only stream, the access pattern of reading weights
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    read = src.numel() * 4 / best
    return {"gemm_flop_per_s": gemm, "gemm_n": gemm_n, "copy_bytes_per_s": copy, "copy_mib": copy_mib,
            "read_bytes_per_s": read}


def _load_hf(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _pad_id(model) -> int:
    gc = model.generation_config
    for cand in (gc.pad_token_id, gc.eos_token_id, 0):
        if isinstance(cand, list):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def worker_nanoserve(task: dict[str, Any]) -> list[Measured]:
    """nanoserve at every slot count on every workload, a fresh Engine per point over one loaded model."""
    from nanoserve import Engine, EngineConfig
    from nanoserve.baseline import check_concurrent, run_concurrent
    from nanoserve.model.kv_cache import bytes_per_block

    max_len = task["max_model_len"]
    block = EngineConfig().block_size
    one_request = -(-max_len // block)  # the loading engine's KV pool: one request, not the 512 MiB default
    base = Engine.from_pretrained(None, EngineConfig(max_model_len=max_len, num_kv_blocks=one_request))
    model, tok = base.model, base.tokenizer
    del base
    per_block = bytes_per_block(model.config, block, model.dtype)
    out = []
    first = True
    for name, wl in task["workloads"].items():
        longest = max(len(p) + n for p, n in zip(wl["prompts"], wl["output_lens"], strict=True))
        if first:  # warm-up, uncounted: allocation and kernel selection
            warm = EngineConfig(max_model_len=max_len, max_num_seqs=2, num_kv_blocks=2 * one_request)
            run_concurrent(Engine(model, tok, warm), wl["prompts"][:2], 4)
            first = False
        for slots in task["slots"]:
            # One slot serves one request at a time: like the serial peers it runs the first
            # serial_requests (the rate of a serial run does not depend on how many it runs).
            k = min(task["serial_requests"], len(wl["prompts"])) if slots == 1 else len(wl["prompts"])
            prompts, lens = wl["prompts"][:k], wl["output_lens"][:k]
            # Enough KV blocks that every slot can hold the longest request: no preemption.
            blocks = min(slots, len(prompts)) * (-(-longest // block)) + slots
            config = EngineConfig(max_num_seqs=slots, max_model_len=max_len, num_kv_blocks=blocks)
            _log(f"nanoserve {name} slots={slots}")
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
                m.error = _error_text(e)
            out.append(m)
    return out


def worker_hf_serial(task: dict[str, Any]) -> list[Measured]:
    """transformers `generate`, one request at a time, on the first `serial_requests` of each workload."""
    from nanoserve.baseline import check_serial, hf_generate_one, run_serial

    model = _load_hf(task["model_dir"])
    generate_one = hf_generate_one(model)
    out = []
    for name, wl in task["workloads"].items():
        k = min(task["serial_requests"], len(wl["prompts"]))
        prompts, lens = wl["prompts"][:k], wl["output_lens"][:k]
        generate_one(prompts[0], 4)  # warm-up, uncounted
        _log(f"hf-generate {name} serial x{k}")
        m = Measured(workload=name, system=HF_SERIAL, concurrency=1)
        try:
            m.run = check_serial(run_serial(generate_one, prompts, lens, system=HF_SERIAL))
            m.steps = m.run.output_tokens
        except Exception as e:
            m.error = _error_text(e)
        out.append(m)
    return out


def hf_static_run(model, prompts: Sequence[Sequence[int]], lens: Sequence[int], batch_size: int) -> tuple[SystemRun, int]:
    """`generate` over left-padded batches in workload order; each batch runs to its longest output."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class EveryStepStamp(LogitsProcessor):
        """Stamps each generation step as its scores exist; never changes them."""

        def __init__(self) -> None:
            self.stamps: list[float] = []

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            self.stamps.append(time.perf_counter())
            return scores

    pad = _pad_id(model)
    records: list[RunRecord | None] = [None] * len(prompts)
    steps = 0
    start = time.perf_counter()
    for batch in static_batches(len(prompts), batch_size):
        batch_start = time.perf_counter()
        ids, mask = left_pad([prompts[i] for i in batch], pad)
        max_new = max(lens[i] for i in batch)
        stamp = EveryStepStamp()
        with torch.inference_mode():
            out = model.generate(
                torch.tensor(ids, dtype=torch.long),  # [B, T] left-padded
                attention_mask=torch.tensor(mask, dtype=torch.long),  # [B, T], 0 on padding
                max_new_tokens=max_new,
                do_sample=False,
                num_beams=1,
                repetition_penalty=1.0,
                eos_token_id=None,  # EOS ignored, as every other system here
                pad_token_id=pad,
                logits_processor=LogitsProcessorList([stamp]),
            )  # [B, T + max_new]
        width = len(ids[0])
        toks = [out[row, width : width + lens[i]].tolist() for row, i in enumerate(batch)]
        for i, rec in zip(
            batch,
            step_stamped_records(start, batch_start, stamp.stamps, [len(prompts[i]) for i in batch], toks),
            strict=True,
        ):
            records[i] = rec
        steps += len(stamp.stamps)
    wall = time.perf_counter() - start
    return SystemRun(system=HF_STATIC, records=tuple(records), wall_s=wall, slots=batch_size), steps


def worker_hf_static(task: dict[str, Any]) -> list[Measured]:
    """transformers `generate` with static padded batches at each peer concurrency."""
    model = _load_hf(task["model_dir"])
    out = []
    first = True
    for name, wl in task["workloads"].items():
        if first:
            hf_static_run(model, wl["prompts"][:2], [4, 4], 2)  # warm-up, uncounted
            first = False
        for c in task["concurrency"]:
            _log(f"hf-static-batch {name} batch={c}")
            m = Measured(workload=name, system=HF_STATIC, concurrency=c, note="batches in workload order")
            try:
                m.run, m.steps = hf_static_run(model, wl["prompts"], wl["output_lens"], c)
            except Exception as e:
                m.error = _error_text(e)
            out.append(m)
    return out


def hf_cb_run(model, prompts: Sequence[Sequence[int]], lens: Sequence[int], concurrency: int, page_size: int) -> SystemRun:
    """transformers' continuous batching, every request offered at once, EOS disabled per request."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(len(p) + n for p, n in zip(prompts, lens, strict=True))
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(lens), eos_token_id=-1, pad_token_id=_pad_id(model))
    cb = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=concurrency * (-(-longest // page_size)) + concurrency,  # CPU: no GPU memory to infer from
        max_batch_tokens=2048,  # the same token budget per step as nanoserve's default
        max_requests_per_batch=concurrency,
        allow_block_sharing=False,  # random prompts share nothing; keep the prefix cache out of it
        use_cuda_graph=False,
        use_async_batching=False,
    )
    records: dict[str, Any] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=30
    ) as manager:
        start = time.perf_counter()
        rids = [
            manager.add_request(list(p), request_id=f"r{i}", max_new_tokens=n, record_timestamps=True, eos_token_id=-1)
            for i, (p, n) in enumerate(zip(prompts, lens, strict=True))
        ]
        while len(records) < len(rids):
            result = manager.get_result(timeout=1.0)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped before finishing")
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                records[result.request_id] = result
        wall = time.perf_counter() - start
    recs = []
    for rid, plen in zip(rids, (len(p) for p in prompts), strict=True):
        r = records[rid]
        stamps = r.timestamps
        scheduled = r.lifespan[0] if r.lifespan[0] >= start else start
        recs.append(
            RunRecord(
                prompt_len=plen,
                token_ids=tuple(r.generated_tokens),
                arrival_s=start,
                first_token_s=stamps[0],
                finished_s=stamps[-1],
                served_s=stamps[-1] - scheduled,
                prefill_s=stamps[0] - scheduled,
            )
        )
    return SystemRun(system=HF_CB, records=tuple(recs), wall_s=wall, slots=concurrency)


def worker_hf_cb(task: dict[str, Any]) -> list[Measured]:
    """transformers' continuous batching at each peer concurrency; a failure becomes the row's error."""
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model = _load_hf(task["model_dir"])
    out = []
    warm_error = ""
    try:
        first = next(iter(task["workloads"].values()))
        hf_cb_run(model, first["prompts"][:2], [4, 4], 2, task["page_size"])  # warm-up, uncounted
    except Exception as e:
        warm_error = _error_text(e)
    for name, wl in task["workloads"].items():
        for c in task["concurrency"]:
            m = Measured(
                workload=name, system=HF_CB, concurrency=c,
                note=f"page {task['page_size']}, sdpa, max_requests_per_batch={c}",
            )
            if warm_error:
                m.error = warm_error
            else:
                _log(f"hf-continuous-batching {name} max_requests_per_batch={c}")
                try:
                    m.run = hf_cb_run(model, wl["prompts"], wl["output_lens"], c, task["page_size"])
                except Exception as e:
                    m.error = _error_text(e)
            out.append(m)
    return out


def worker_llama_py(task: dict[str, Any]) -> list[Measured]:
    """llama.cpp through llama-cpp-python, greedy, one request at a time, f32 weights and KV cache."""
    import llama_cpp
    from llama_cpp import Llama

    from nanoserve.baseline import check_serial, run_serial

    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    llm = Llama(
        model_path=task["gguf"], n_ctx=task["max_model_len"], n_batch=512, n_ubatch=512,
        n_threads=task["threads"], n_threads_batch=task["threads"], type_k=f32, type_v=f32, seed=0, verbose=False,
    )

    def generate_one(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float | None]:
        llm.reset()
        tokens: list[int] = []
        first = None
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens:
                break
        return tokens, first

    out = []
    for name, wl in task["workloads"].items():
        k = min(task["serial_requests"], len(wl["prompts"]))
        generate_one(wl["prompts"][0], 4)  # warm-up, uncounted
        _log(f"llama-cpp-python {name} serial x{k}")
        m = Measured(workload=name, system=LLAMA_PY, concurrency=1, note="f32 GGUF, f32 KV")
        try:
            m.run = check_serial(run_serial(generate_one, wl["prompts"][:k], wl["output_lens"][:k], system=LLAMA_PY))
            m.steps = m.run.output_tokens
        except Exception as e:
            m.error = _error_text(e)
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
    """Entry point of a `--worker` subprocess: read the task, run it, write the result beside it."""
    import torch

    task = json.loads(Path(task_path).read_text())
    torch.set_num_threads(task["threads"])
    kind = task["kind"]
    if kind == "limits":
        result: Any = measure_limits(task["gemm_n"], task["copy_mib"])
    else:
        result = [_measured_to_json(m) for m in WORKERS[kind](task)]
    Path(task_path + ".out.json").write_text(json.dumps(result))


# ---- the parent: one subprocess per system, one after another --------------------------------------


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


def run_child(cmd: list[str], timeout_s: float, result_path: Path | None) -> ChildResult:
    """Run one child to completion (or kill its process group at the timeout) and read its own peak RSS."""
    start = time.perf_counter()
    with tempfile.NamedTemporaryFile(prefix="peerbench-rss-", delete=False) as f:
        rss_path = Path(f.name)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(rss_path), *cmd],
            stdout=subprocess.PIPE if result_path is None else None, text=True, start_new_session=True,
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
    """Run `kind` in a fresh `python peerbench.py --worker` subprocess."""
    path = tmp / f"{kind}.json"
    path.write_text(json.dumps(task | {"kind": kind}))
    out = Path(str(path) + ".out.json")
    out.unlink(missing_ok=True)
    return run_child([sys.executable, str(Path(__file__).resolve()), "--worker", str(path)], timeout_s, out)


def run_batched_bench(
    binary: Path, gguf: Path, shapes: dict[str, tuple[int, int]], concurrency: Sequence[int], threads: int,
    timeout_s: float,
) -> tuple[list[Measured], float]:
    """llama-batched-bench once per workload shape (equal lengths), f32 KV; returns rows and peak RSS."""
    out: list[Measured] = []
    peak = 0.0
    for name, (pp, tg) in shapes.items():
        npl = sorted(set(concurrency))
        cmd = [
            str(binary), "-m", str(gguf), "-c", str(max(npl) * (pp + tg)), "-b", "2048", "-ub", "512",
            "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, npl)), "-t", str(threads), "-tb", str(threads),
            "-ctk", "f32", "-ctv", "f32", "--output-format", "jsonl",
        ]
        _log(f"llama-batched-bench {name} pp={pp} tg={tg} npl={npl}")
        child = run_child(cmd, timeout_s, None)
        peak = max(peak, child.peak_rss_mib)
        rows = {int(r["pl"]): r for r in parse_batched_bench(child.result or "")}
        note = "equal lengths" if name == "offline" else f"equal-length stand-in at the ragged means pp={pp} tg={tg}"
        for pl in npl:
            m = Measured(workload=name, system=LLAMA_BATCHED, concurrency=pl, note=note)
            r = rows.get(pl)
            if r is None:
                m.error = child.error or "no result row for this number of sequences"
            else:
                m.output_tokens, m.prompt_tokens = pl * tg, pl * pp
                m.wall_s, m.ttft_s, m.tpot_s = float(r["t"]), float(r["t_pp"]), float(r["t_tg"]) / tg
                m.steps = tg
            out.append(m)
    return out, peak


# ---- rows, gates, outputs ------------------------------------------------------------------------------


COLUMNS = [
    "workload", "system", "concurrency", "requests", "prompt_tokens", "output_tokens", "wall_s",
    "output_tok_per_s", "mean_ttft_s", "ttft_includes_queue", "mean_tpot_s", "decode_tok_per_s",
    "peak_rss_mib", "nanoserve_x", "nanoserve_decode_x", "tokens_vs_reference", "identical_requests",
    "gemm_fraction", "gemm_fraction_all_tokens", "bw_fraction_decode", "bw_fraction_decode_vs_read", "steps",
    "note", "error",
]


def row_from(m: Measured, peak_rss_mib: float | None) -> dict[str, Any]:
    """One CSV row (units in the column names) from a measurement; ratios and fractions filled later."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row |= {"workload": m.workload, "system": m.system, "concurrency": m.concurrency, "note": m.note, "error": m.error}
    row["peak_rss_mib"] = round(peak_rss_mib, 1) if peak_rss_mib is not None else ""
    if m.steps is not None:
        row["steps"] = m.steps
    if m.extra.get("kv_cache_mib") is not None:
        row["note"] = (row["note"] + "; " if row["note"] else "") + f"KV cache {m.extra['kv_cache_mib']:.0f} MiB"
    if m.run is not None:
        run = m.run
        row |= {
            "requests": run.num_requests,
            "prompt_tokens": sum(r.prompt_len for r in run.records),
            "output_tokens": run.output_tokens,
            "wall_s": run.wall_s,
            "output_tok_per_s": run.throughput,
            "mean_ttft_s": run.mean_ttft_s,
            # a serial system is handed one request at a time, so its TTFT is its prefill alone
            "ttft_includes_queue": m.system not in SERIAL_SYSTEMS,
            "mean_tpot_s": mean_tpot_s(run) or "",
            "decode_tok_per_s": decode_tok_per_s(run) or "",
        }
    elif m.wall_s is not None and m.output_tokens is not None:
        row |= {
            "requests": m.concurrency,
            "prompt_tokens": m.prompt_tokens,
            "output_tokens": m.output_tokens,
            "wall_s": m.wall_s,
            "output_tok_per_s": m.output_tokens / m.wall_s,
            "mean_ttft_s": m.ttft_s,
            "ttft_includes_queue": False,
            "mean_tpot_s": m.tpot_s,
            "decode_tok_per_s": 1.0 / m.tpot_s if m.tpot_s else "",
            "tokens_vs_reference": "no token ids (synthetic prompts)",
        }
    return row


def add_ratios(rows: list[dict[str, Any]], nano_heads: dict[tuple[str, int], SystemRun]) -> None:
    """nanoserve_x = nanoserve output tok/s / this row's, at the same workload and concurrency.

    A serial row that ran only the first k requests is put beside nanoserve's one-slot run cut to
    those k (`head_of_run`), so both sides did the same requests. `nano_heads[(workload, k)]`.
    """
    nano = {(r["workload"], r["concurrency"]): r for r in rows if r["system"] == NANOSERVE and r["output_tok_per_s"] != ""}
    for row in rows:
        if row["system"] == NANOSERVE or row["output_tok_per_s"] in ("", 0):
            continue
        head = nano_heads.get((row["workload"], row["requests"])) if row["system"] in SERIAL_SYSTEMS else None
        if head is not None:
            row["nanoserve_x"] = head.throughput / row["output_tok_per_s"]
            d = decode_tok_per_s(head)
            if d and row["decode_tok_per_s"]:
                row["nanoserve_decode_x"] = d / row["decode_tok_per_s"]
            continue
        ref = nano.get((row["workload"], row["concurrency"]))
        if ref is not None:
            row["nanoserve_x"] = ref["output_tok_per_s"] / row["output_tok_per_s"]
            if ref["decode_tok_per_s"] and row["decode_tok_per_s"]:
                row["nanoserve_decode_x"] = ref["decode_tok_per_s"] / row["decode_tok_per_s"]


def add_fractions(rows: list[dict[str, Any]], limits: dict[str, float], num_params: int, weight_bytes: int) -> None:
    """gemm_fraction (output tokens), gemm_fraction_all_tokens (prompt + output), and the decode
    bandwidth fractions: weight bytes x (1 / mean TPOT) against the copy and the read-only rates."""
    for row in rows:
        if row["output_tok_per_s"] == "":
            continue
        row["gemm_fraction"] = gemm_fraction(num_params, row["output_tok_per_s"], limits["gemm_flop_per_s"])
        all_tok_s = (row["prompt_tokens"] + row["output_tokens"]) / row["wall_s"]
        row["gemm_fraction_all_tokens"] = gemm_fraction(num_params, all_tok_s, limits["gemm_flop_per_s"])
        if row["mean_tpot_s"]:
            steps_per_s = 1.0 / row["mean_tpot_s"]  # one decode step per output token of a row
            row["bw_fraction_decode"] = bandwidth_fraction(weight_bytes, steps_per_s, limits["copy_bytes_per_s"])
            if limits.get("read_bytes_per_s"):
                row["bw_fraction_decode_vs_read"] = bandwidth_fraction(
                    weight_bytes, steps_per_s, limits["read_bytes_per_s"]
                )


def _fmt(v: Any, spec: str) -> str:
    if v == "" or v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def render_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of the rows, one line each; errors shown in place of numbers."""
    head = (f"{'workload':<8} {'system':<23} {'conc':>4} {'req':>4} {'out tok':>7} {'tok/s':>8} {'TTFT s':>7} "
            f"{'TPOT ms':>8} {'dec tok/s':>9} {'RSS MiB':>8} {'nano x':>7} {'GEMM%':>6} {'BW%':>5}  tokens")
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = f"{r['workload']:<8} {r['system']:<23} {r['concurrency']:>4} "
        if r["error"] and r["output_tok_per_s"] == "":
            lines.append(lead + f"  not run: {r['error']}")
            continue
        tpot = r["mean_tpot_s"] * 1000 if r["mean_tpot_s"] != "" else ""
        gemm = r["gemm_fraction"] * 100 if r["gemm_fraction"] != "" else ""
        bw = r["bw_fraction_decode"] * 100 if r["bw_fraction_decode"] != "" else ""
        lines.append(
            lead + f"{_fmt(r['requests'], 'd'):>4} {_fmt(r['output_tokens'], 'd'):>7} "
            f"{_fmt(r['output_tok_per_s'], '.2f'):>8} {_fmt(r['mean_ttft_s'], '.2f'):>7} {_fmt(tpot, '.1f'):>8} "
            f"{_fmt(r['decode_tok_per_s'], '.2f'):>9} {_fmt(r['peak_rss_mib'], '.0f'):>8} "
            f"{_fmt(r['nanoserve_x'], '.2f'):>7} {_fmt(gemm, '.1f'):>6} {_fmt(bw, '.1f'):>5}  {r['tokens_vs_reference']}"
        )
    return "\n".join(lines)


def write_png(rows: list[dict[str, Any]], path: Path) -> str:
    """Output tokens/s against concurrency, one line per system, one panel per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.8), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        for system in SYSTEMS:
            pts = sorted(
                (r["concurrency"], r["output_tok_per_s"])
                for r in rows
                if r["workload"] == wl and r["system"] == system and r["output_tok_per_s"] != ""
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] for r in rows if r["workload"] == wl and r["output_tok_per_s"] != ""})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency (slots / batch size / sequences)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{wl} workload")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


def setup_llamacpp(python: str = sys.executable) -> None:
    """Once: fetch the llama-cpp-python sdist, write the f32 GGUF, build llama-batched-bench (all under .peers/).

    Does not `pip install llama-cpp-python` (a change to the environment, several minutes of
    compiling); prints the command instead.
    """
    from nanoserve.model.default import default_model_dir

    PEERS_DIR.mkdir(exist_ok=True)
    sdists = sorted(PEERS_DIR.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        subprocess.run([python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_SDIST,
                        "-d", str(PEERS_DIR)], check=True)
        sdists = sorted(PEERS_DIR.glob("llama_cpp_python-*.tar.gz"))
    src = PEERS_DIR / sdists[-1].name.removesuffix(".tar.gz")
    if not src.is_dir():
        subprocess.run(["tar", "xzf", str(sdists[-1]), "-C", str(PEERS_DIR)], check=True)
    vendor = src / "vendor" / "llama.cpp"
    gguf = PEERS_DIR / GGUF_NAME
    if not gguf.is_file():
        pylib = PEERS_DIR / "pylib"  # sentencepiece for the converter, kept out of the venv
        if not (pylib / "sentencepiece").is_dir():
            subprocess.run([python, "-m", "pip", "install", "-q", "--target", str(pylib), "sentencepiece"], check=True)
        env = os.environ | {"PYTHONPATH": f"{vendor / 'gguf-py'}{os.pathsep}{pylib}"}
        subprocess.run([python, str(vendor / "convert_hf_to_gguf.py"), str(default_model_dir()), "--outtype", "f32",
                        "--outfile", str(gguf)], check=True, env=env)
    if not BATCHED_BENCH.is_file():
        build = BATCHED_BENCH.parent.parent
        start = time.perf_counter()
        subprocess.run(["cmake", "-S", str(vendor), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(build), "--target", "llama-batched-bench", "-j", str(os.cpu_count())],
                       check=True)
        print(f"built {BATCHED_BENCH} in {time.perf_counter() - start:.0f} s")
    print(f"GGUF: {gguf}\nllama-batched-bench: {BATCHED_BENCH}")
    print("llama-cpp-python (optional, compiles llama.cpp for minutes): "
          f"CMAKE_ARGS=-DGGML_NATIVE=ON {python} -m pip install {sdists[-1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--setup-llamacpp", action="store_true", help="fetch/convert/build the llama.cpp peers, then exit")
    parser.add_argument("--quick", action="store_true", help="8 requests, short lengths, slots 1 4 8: about 2 minutes")
    parser.add_argument("--skip-llamacpp", action="store_true", help="leave both llama.cpp systems out")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    parser.add_argument("--slots", type=int, nargs="+", default=None, help="nanoserve slot counts")
    parser.add_argument("--peer-concurrency", type=int, nargs="+", default=None,
                        help="batch sizes of the batched peers (static batch, continuous batching, batched-bench)")
    parser.add_argument("--serial-requests", type=int, default=None, help="requests the serial peers run per workload")
    parser.add_argument("--offline", type=int, nargs=3, metavar=("N", "PROMPT", "OUTPUT"), default=None)
    parser.add_argument("--ragged", type=int, nargs=5, metavar=("N", "P_LO", "P_HI", "O_LO", "O_HI"), default=None)
    parser.add_argument("--page-size", type=int, default=256, help="transformers continuous batching page size")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before one system's subprocess is killed")
    parser.add_argument("--out", default="runs/peerbench", help="output directory")
    args = parser.parse_args()
    if args.worker:
        worker_main(args.worker)
        return
    if args.setup_llamacpp:
        setup_llamacpp()
        return

    quick = args.quick
    slots = args.slots or ([1, 4, 8] if quick else [1, 2, 4, 8, 16, 32, 64])
    peer_conc = args.peer_concurrency or ([4, 8] if quick else [16, 32])
    serial_k = args.serial_requests or (4 if quick else 8)
    off = args.offline or ([8, 32, 16] if quick else [32, 64, 64])
    rag = args.ragged or ([8, 16, 64, 8, 32] if quick else [64, 32, 512, 32, 128])
    for name, values in (("--slots", slots), ("--peer-concurrency", peer_conc)):
        if min(values) < 1:
            raise SystemExit(f"{name} {values}: every value must be >= 1")

    from nanoserve.model.default import default_model_dir

    model_dir = default_model_dir()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    num_params, weight_bytes = safetensors_sizes(model_dir / "model.safetensors")
    workloads: dict[str, Workload] = {
        "offline": offline_workload(off[0], off[1], off[2], vocab, seed=0),
        "ragged": ragged_workload(rag[0], (rag[1], rag[2]), (rag[3], rag[4]), vocab, seed=0),
    }
    max_len = max(len(p) + n for w in workloads.values() for p, n in zip(w.prompts, w.output_lens, strict=True))
    max_len = 64 * (-(-max_len // 64))
    wl_json = {name: {"prompts": w.prompts, "output_lens": w.output_lens} for name, w in workloads.items()}
    common = {"threads": args.threads, "model_dir": str(model_dir), "workloads": wl_json, "max_model_len": max_len,
              "serial_requests": serial_k}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    systems = [s for s in args.systems if not (args.skip_llamacpp and s in (LLAMA_PY, LLAMA_BATCHED))]

    print(f"peerbench: {time.strftime('%Y-%m-%d %H:%M')}, {args.threads} threads, fp32, greedy, EOS ignored; "
          f"model {num_params / 1e6:.1f}M params, {weight_bytes / 2**20:.0f} MiB of weights")
    for name, w in workloads.items():
        plens = [len(p) for p in w.prompts]
        print(f"  {name}: {w.num_requests} requests, prompts {min(plens)}..{max(plens)} (mean {sum(plens) / len(plens):.0f}), "
              f"outputs {min(w.output_lens)}..{max(w.output_lens)} (mean {w.num_output_tokens / w.num_requests:.0f})")
    print(f"  nanoserve slots {slots}; batched peers at {peer_conc}; serial peers on the first {serial_k} requests",
          flush=True)

    measured: list[tuple[Measured, float | None]] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="peerbench-") as tmp_s:
        tmp = Path(tmp_s)
        _log("limits: GEMM peak and copy bandwidth")
        lim = run_worker("limits", {"threads": args.threads, "gemm_n": 2048, "copy_mib": 256}, tmp, 600)
        if lim.error:
            raise SystemExit(f"could not measure the machine limits: {lim.error}")
        limits = lim.result
        for system in systems:
            if system == LLAMA_PY and not _has_module("llama_cpp"):
                skipped.append(f"{LLAMA_PY}: not installed (optional: `python peerbench.py --setup-llamacpp` "
                               "prints the pip command)")
                continue
            gguf = PEERS_DIR / GGUF_NAME
            if system in (LLAMA_PY, LLAMA_BATCHED) and not gguf.is_file():
                skipped.append(f"{system}: no f32 GGUF at {gguf} (run `python peerbench.py --setup-llamacpp`)")
                continue
            if system == LLAMA_BATCHED:
                if not BATCHED_BENCH.is_file():
                    skipped.append(f"{LLAMA_BATCHED}: not built at {BATCHED_BENCH} "
                                   "(run `python peerbench.py --setup-llamacpp`)")
                    continue
                shapes = {
                    name: (round(w.num_prompt_tokens / w.num_requests), round(w.num_output_tokens / w.num_requests))
                    for name, w in workloads.items()
                }
                rows_b, peak_b = run_batched_bench(BATCHED_BENCH, gguf, shapes, sorted({1, *peer_conc}),
                                                   args.threads, args.timeout)
                measured += [(m, peak_b) for m in rows_b]
                continue
            task = common | {"slots": slots, "concurrency": peer_conc, "page_size": args.page_size, "gguf": str(gguf)}
            _log(f"{system}: starting its subprocess")
            child = run_worker(system, task, tmp, args.timeout)
            _log(f"{system}: done in {child.seconds:.0f} s, peak RSS {child.peak_rss_mib:.0f} MiB")
            if child.error:
                m = Measured(workload="all", system=system, concurrency=0, error=f"subprocess {child.error}")
                measured.append((m, child.peak_rss_mib))
                continue
            measured += [(_measured_from_json(d), child.peak_rss_mib) for d in child.result]

    rows, failures, divergence_rows = build_rows(measured, serial_k)
    add_fractions(rows, limits, num_params, weight_bytes)
    print()
    print(f"machine limits (same run): fp32 GEMM {limits['gemm_flop_per_s'] / 1e9:.1f} GFLOP/s at "
          f"{limits['gemm_n']}^3; copy {limits['copy_bytes_per_s'] / 1e9:.2f} GB/s (read + write, "
          f"{limits['copy_mib']} MiB); read-only {limits['read_bytes_per_s'] / 1e9:.2f} GB/s; one decode step "
          f"reads {weight_bytes / 1e6:.0f} MB of weights, so one row is capped near "
          f"{limits['copy_bytes_per_s'] / weight_bytes:.1f} steps/s at the copy rate, "
          f"{limits['read_bytes_per_s'] / weight_bytes:.1f} at the read rate")
    for line in skipped:
        print(f"skipped {line}")
    print()
    print(render_table(rows))
    date = time.strftime("%Y-%m-%d")
    for r in rows:
        r["threads"], r["date"] = args.threads, date
        r["gemm_peak_gflop_per_s"] = limits["gemm_flop_per_s"] / 1e9
        r["copy_gb_per_s"] = limits["copy_bytes_per_s"] / 1e9
        r["read_gb_per_s"] = limits["read_bytes_per_s"] / 1e9
    for line in skipped:
        rows.append(dict.fromkeys(rows[0] if rows else COLUMNS, "") | {
            "workload": "all", "system": line.split(":")[0], "concurrency": "", "error": "skipped: " + line,
            "date": date, "threads": args.threads})
    csv_path = out_dir / "peerbench.csv"
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    div_path = out_dir / "peerbench_divergence.csv"
    with div_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["workload", "system", "concurrency", "reference", "request",
                                               "prompt_len", "output_len", "first_divergence"])
        writer.writeheader()
        writer.writerows(divergence_rows)
    print()
    print(f"wrote {csv_path} and {div_path}")
    print(write_png([r for r in rows if r["workload"] != "all"], out_dir / "peerbench.png"))
    if failures:
        print()
        for line in failures:
            print(f"GATE FAILED: {line}")
        raise SystemExit(1)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def _first(run: SystemRun, k: int) -> SystemRun:
    """The first k records of a run, for comparing token ids with a run that did only those (wall kept)."""
    return SystemRun(system=run.system, records=run.records[:k], wall_s=run.wall_s, slots=run.slots)


def build_rows(
    measured: list[tuple[Measured, float | None]], serial_k: int
) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """Rows in run order, the token gates that failed, and one divergence row per request that split.

    Gates (failures): nanoserve at every slot count against hf-generate on the requests hf-generate
    ran, and against nanoserve's fullest run (the reference) on the requests both ran, both with
    `compare`. Reports (no gate): every other system against the reference, request by request.
    """
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    div_rows: list[dict[str, Any]] = []
    nano_ref: dict[str, SystemRun] = {}  # per workload: the nanoserve run holding the most requests
    hf_serial: dict[str, SystemRun] = {}
    nano_heads: dict[tuple[str, int], SystemRun] = {}  # the one-slot run cut to what the serial peers ran
    for m, _ in measured:
        if m.run is None:
            continue
        if m.system == NANOSERVE:
            best = nano_ref.get(m.workload)
            if best is None or m.run.num_requests > best.num_requests:
                nano_ref[m.workload] = m.run
            if m.concurrency == 1:
                k = min(serial_k, m.run.num_requests)
                nano_heads[(m.workload, k)] = head_of_run(m.run, k)
        if m.system == HF_SERIAL:
            hf_serial[m.workload] = m.run
    for m, peak in measured:
        row = row_from(m, peak)
        rows.append(row)
        if m.run is None:
            continue
        ids = [r.token_ids for r in m.run.records]
        ref = nano_ref.get(m.workload)
        if m.system == NANOSERVE:
            checks = []
            references = [(hf_serial.get(m.workload), HF_SERIAL)]
            if ref is not None and ref is not m.run:
                references.append((ref, f"nanoserve slots={ref.slots}"))
            for other, label in references:
                if other is None:
                    continue
                k = min(other.num_requests, m.run.num_requests)
                try:
                    compare(_first(other, k), _first(m.run, k))
                    checks.append(f"= {label} on {k}/{k}")
                except UnfairComparison as e:
                    failures.append(f"{m.workload} nanoserve slots={m.concurrency} vs {label}: {e}")
                    checks.append(f"MISMATCH vs {label}")
            row["tokens_vs_reference"] = "; ".join(checks) or "no reference ran"
            row["identical_requests"] = "" if "MISMATCH" in row["tokens_vs_reference"] else m.run.num_requests
            continue
        if m.system == HF_SERIAL:
            row["tokens_vs_reference"] = "the reference (nanoserve must equal it)"
            continue
        if ref is None or ref.num_requests < len(ids):
            row["tokens_vs_reference"] = "no nanoserve run of these requests to compare with"
            continue
        rep = divergence_report([r.token_ids for r in ref.records[: len(ids)]], ids)
        row["tokens_vs_reference"] = f"vs nanoserve (= {HF_SERIAL}): {rep.summary()}"
        row["identical_requests"] = rep.identical
        for i, split in enumerate(rep.splits):
            if split is not None:
                div_rows.append({
                    "workload": m.workload, "system": m.system, "concurrency": m.concurrency,
                    "reference": f"nanoserve slots={ref.slots}", "request": i,
                    "prompt_len": m.run.records[i].prompt_len, "output_len": m.run.records[i].output_len,
                    "first_divergence": split,
                })
    add_ratios(rows, nano_heads)
    return rows, failures, div_rows


if __name__ == "__main__":
    main()
