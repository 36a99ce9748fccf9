"""The transformers peers, each run inside its worker subprocess: `generate` one request at a time,
`generate` over static left-padded batches, and transformers' own continuous batching."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.peerbench.measured import HF_CB, HF_SERIAL, HF_STATIC, Measured, error_text, log
from nanoserve.instruments.baseline import RunRecord, SystemRun


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


def worker_hf_serial(task: dict[str, Any]) -> list[Measured]:
    """transformers `generate`, one request at a time, on the first `serial_requests` of each workload."""
    from nanoserve.instruments.baseline import check_serial
    from nanoserve.instruments.runners import hf_generate_one, run_serial

    model = _load_hf(task["model_dir"])
    generate_one = hf_generate_one(model)
    out = []
    for name, wl in task["workloads"].items():
        k = min(task["serial_requests"], len(wl["prompts"]))
        prompts, lens = wl["prompts"][:k], wl["output_lens"][:k]
        generate_one(prompts[0], 4)  # warm-up, uncounted
        log(f"hf-generate {name} serial x{k}")
        m = Measured(workload=name, system=HF_SERIAL, concurrency=1)
        try:
            m.run = check_serial(run_serial(generate_one, prompts, lens, system=HF_SERIAL))
            m.steps = m.run.output_tokens
        except Exception as e:
            m.error = error_text(e)
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
            log(f"hf-static-batch {name} batch={c}")
            m = Measured(workload=name, system=HF_STATIC, concurrency=c, note="batches in workload order")
            try:
                m.run, m.steps = hf_static_run(model, wl["prompts"], wl["output_lens"], c)
            except Exception as e:
                m.error = error_text(e)
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
        warm_error = error_text(e)
    for name, wl in task["workloads"].items():
        for c in task["concurrency"]:
            m = Measured(
                workload=name, system=HF_CB, concurrency=c,
                note=f"page {task['page_size']}, sdpa, max_requests_per_batch={c}",
            )
            if warm_error:
                m.error = warm_error
            else:
                log(f"hf-continuous-batching {name} max_requests_per_batch={c}")
                try:
                    m.run = hf_cb_run(model, wl["prompts"], wl["output_lens"], c, task["page_size"])
                except Exception as e:
                    m.error = error_text(e)
            out.append(m)
    return out

