"""The runners that produce a SystemRun: one request at a time through any generate function
(transformers' `generate` with its first token stamped by a LogitsProcessor), and the engine's own
concurrent run read from its own stamps."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from nanoserve.instruments.baseline import RunUnsound, SystemRun
from nanoserve.instruments.metrics import request_metrics
from nanoserve.instruments.record import RunRecord
from nanoserve.params import SamplingParams

if TYPE_CHECKING:
    from nanoserve.engine import Engine

# a one-at-a-time generator: (prompt ids, max new tokens) -> (output ids, first-token perf_counter stamp, ...)
GenerateOne = Callable[[list[int], int], tuple[Any, ...]]


def _as_len_list(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    lens = [max_new_tokens] * n if isinstance(max_new_tokens, int) else [int(x) for x in max_new_tokens]
    if len(lens) != n:
        raise ValueError(f"{len(lens)} output lengths for {n} prompts; need one per prompt")
    for i, m in enumerate(lens):
        if m < 1:
            raise ValueError(f"max_new_tokens[{i}]={m} must be >= 1")
    return lens


def run_serial(
    generate_one: GenerateOne,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    system: str = "hf-generate",
) -> SystemRun:
    """Drive a one-at-a-time generator over the prompts, one call each, and record the run.

    `generate_one(prompt_ids, max_new_tokens)` returns `(token_ids, first_token_s, ...)` where
    `first_token_s` is a `time.perf_counter()` stamp taken when the first token existed; anything
    after it is ignored. Each request arrives when its call starts and finishes when it returns,
    and holds the only slot throughout (served_s = e2e). There is no queue, so the whole wait for
    token one is the prompt forward: prefill_s = ttft_s, deliberately.

    Raises:
        RunUnsound: a first-token stamp falls outside its own call (it is not a perf_counter stamp).
    """
    lens = _as_len_list(max_new_tokens, len(prompts))
    if not prompts:
        raise ValueError("run_serial needs at least 1 prompt, got 0")
    records = []
    start = time.perf_counter()
    for prompt, n in zip(prompts, lens, strict=True):
        arrival = time.perf_counter()
        result = generate_one(list(prompt), n)
        finished = time.perf_counter()
        token_ids, first_token_s = result[0], result[1]
        if first_token_s is None or not arrival <= first_token_s <= finished:
            raise RunUnsound(
                f"first-token stamp {first_token_s} is outside its call [{arrival}, {finished}]; "
                "the generator must stamp with time.perf_counter()"
            )
        e2e = finished - arrival
        records.append(
            RunRecord(
                prompt_len=len(prompt),
                token_ids=tuple(token_ids),
                arrival_s=arrival,
                first_token_s=first_token_s,
                finished_s=finished,
                served_s=e2e,
                prefill_s=first_token_s - arrival,
            )
        )
    wall = time.perf_counter() - start
    return SystemRun(system=system, records=tuple(records), wall_s=wall, slots=1)


def hf_generate_one(model: Any) -> GenerateOne:
    """A one-at-a-time generator over transformers' `model.generate`, greedy, EOS ignored.

    TTFT is stamped by a `LogitsProcessor`: generate hands it each step's scores as they are
    produced, so its first call is the instant the prompt forward finished. It stamps (after a
    device synchronise, so the clock reads finished work) and returns the scores untouched; the
    generation being timed is exactly the one that would have happened without it.
    """
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    device = next(model.parameters()).device

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    class FirstScoresStamp(LogitsProcessor):
        """Records a perf_counter stamp on its first call; never changes the scores."""

        def __init__(self) -> None:
            self.stamp: float | None = None

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            if self.stamp is None:
                synchronize()
                self.stamp = time.perf_counter()
            return scores

    pad_token_id = model.generation_config.pad_token_id
    if pad_token_id is None:
        pad_token_id = 0  # one sequence, no padding happens; set only to keep generate quiet

    def generate_one(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float | None]:
        stamp = FirstScoresStamp()
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                num_beams=1,
                repetition_penalty=1.0,
                eos_token_id=None,  # the engine runs ignore_eos=True: both must produce every token
                pad_token_id=pad_token_id,
                logits_processor=LogitsProcessorList([stamp]),
            )  # [1, T + max_new_tokens]
        synchronize()
        return out[0, len(prompt_ids) :].tolist(), stamp.stamp

    return generate_one


def run_concurrent(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    system: str | None = None,
) -> SystemRun:
    """Submit every prompt to the engine at once (greedy, ignore_eos) and read its own stamps back.

    Times nothing itself except the wall clock around the whole run: each record is
    `request_metrics` of the engine's final `RequestOutput` (arrival, first scheduled, first token,
    token and finish stamps; served_s from its `running_s` accumulator; prefill_s from
    first_token - first_scheduled). Reusing one engine across runs lets its prefix
    cache serve the second run's prompts; use a fresh engine per run for a clean sweep.

    Raises:
        ValueError: no prompts, bad output lengths, or the engine already has unfinished requests.
    """
    lens = _as_len_list(max_new_tokens, len(prompts))
    if not prompts:
        raise ValueError("run_concurrent needs at least 1 prompt, got 0")
    if engine.has_unfinished():
        raise ValueError("engine has unfinished requests; run_concurrent needs an idle engine")
    slots = engine.config.max_num_seqs
    start = time.perf_counter()
    rids = [
        engine.add_request(list(p), SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lens, strict=True)
    ]
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    wall = time.perf_counter() - start
    records = [request_metrics(final[rid]) for rid in rids]
    return SystemRun(
        system=system if system is not None else f"nanoserve, {slots}",
        records=tuple(records),
        wall_s=wall,
        slots=slots,
    )


def decode_rate(engine: Engine, slots: int, steps: int, prompt_len: int = 64) -> float:
    """Aggregate decode tokens/s with `slots` requests decoding together: the median of `steps`
    decode steps after every prompt is in and one uncounted decode (prefill left out)."""
    return slots / statistics.median(decode_step_times(engine, slots, steps, prompt_len))


def decode_step_times(engine: Engine, slots: int, steps: int, prompt_len: int = 64) -> list[float]:
    """The seconds of `steps` decode steps with `slots` greedy requests of `prompt_len` token
    prompts decoding together, after every prompt is in and one uncounted decode; the requests are
    run to their end afterwards, so the engine is idle again."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
    vocab = engine.model.config.vocab_size
    for i in range(slots):
        engine.add_request([(100 + (i * 7 + j) % 1000) % vocab for j in range(prompt_len)], params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    engine.step()  # the first decode: uncounted
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    return times
