"""syncbench: the sample phase two ways over one real logits tensor, and the readbacks it makes.

"per row" is a sampler that reads each sampled row home on its own, kept below as ``rowwise_sample``: a gather of the
greedy rows then one ``.tolist()``, and one ``int(tensor)`` per sampled row. "one tensor" is
``BatchedSampler.sample_batch_device`` plus the single ``Readback.fetch`` that collect makes. Both
run in this process, seconds apart, over the same ``[slots, vocab]`` logits taken from a real decode
step of the model, with the same seeded noise; the token ids must agree or nothing is printed.
Times are the median of --repeats calls after warm-up, the two paths interleaved.

Syncs are counted, not derived: every ``.tolist``, ``.item``, ``__int__`` (and the other routes a
tensor's value reaches Python) is counted while each path runs once. The transfers per step of
the engine itself are read live from ``Engine.output`` after a short generate.

What a CPU cannot say: a synchronisation saving. There is no bus and no asynchronous queue here,
so removing a sync saves nothing measurable; ``check_measurable`` refuses to price it and the
refusal is printed. The Python saving (the greedy gather that went away) is real here and is
what the "faster" column measures.

    python syncbench.py            # slots 1 2 4 8 16, median of 25
    python syncbench.py --quick    # slots 1 2 4 8, median of 25, shorter engine runs
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.readback_guard import readbacks_counted
from nanoserve.output import (
    NotMeasurable,
    Readback,
    SyncMeasurement,
    check_measurable,
    check_single_transfer,
    measure_transfer_s,
    render,
    saving_per_step,
    syncs_per_step,
)
from nanoserve.profiler import StepRecorder
from nanoserve.sampling import BatchedSampler
from nanoserve.scheduler import cdiv

GREEDY = SamplingParams(temperature=0.0)
TOP_P = SamplingParams(temperature=1.0, top_p=0.9)
PARAMS = {"greedy": GREEDY, "top-p": TOP_P}  # the label syncbench prints -> what every row samples with

# Distinct prompts so the rows of the logits tensor are distinct distributions.
PROMPTS = (
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers, separated by commas:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "Explain why the sky is blue.",
    "The quick brown fox jumps over",
    "My favourite recipe for bread starts with",
    "In 1969 the first people to walk on the moon",
    "A good unit test checks",
    "The three laws of thermodynamics are",
    "Translate to French: good morning",
    "import numpy as np\nx = np.",
    "The best way to learn a language is",
    "Water boils at",
    "Dear hiring manager,",
)

# ----------------------------------------------------------------------------- the "before" path


def rowwise_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    default_generator: torch.Generator | None = None,
) -> list[int]:
    """The per-row sampler, kept here as the "before" of a paired run.

    It lives in this script, not in nanoserve.sampling, so it cannot become a second path the
    engine might take, and the run refuses to print if it ever stops drawing the same tokens.
    The same maths as BatchedSampler (temperature, top-k/top-p/min-p on one sort, exponential
    race), with the two costs the one-tensor sampler removes: greedy rows are gathered (``logits[greedy_rows]``
    copies [G, V] floats) before their argmax, and every sampled row comes home on its own
    ``int(tensor)``, one synchronisation each.

    Returns:
        One token id per row, in row order.
    """
    token_ids = [0] * len(params)
    greedy_rows = [i for i, p in enumerate(params) if p.temperature == 0.0]
    if greedy_rows:
        greedy = logits[greedy_rows].argmax(dim=-1)  # [G]: a gather, then one batched argmax
        for i, token_id in zip(greedy_rows, greedy.tolist(), strict=True):  # one readback
            token_ids[i] = token_id
    sampled_rows = [i for i, p in enumerate(params) if p.temperature > 0.0]
    if not sampled_rows:
        return token_ids
    sub = logits[sampled_rows] if len(sampled_rows) < len(params) else logits  # [S, V]
    sub_params = [params[i] for i in sampled_rows]
    temps = torch.tensor([p.temperature for p in sub_params], dtype=sub.dtype, device=sub.device)
    probs = torch.softmax(sub / temps[:, None], dim=-1)  # [S, V]
    if any(p.has_filters for p in sub_params):
        probs = _rowwise_filter(probs, sub_params)
    noise = torch.empty_like(probs)  # [S, V]
    row_gens = [generators[i] for i in sampled_rows] if generators else []
    if any(g is not None for g in row_gens):
        for j, g in enumerate(row_gens):
            noise[j].exponential_(generator=g or default_generator)
    else:
        noise.exponential_(generator=default_generator)
    for j, i in enumerate(sampled_rows):
        token_ids[i] = int(probs[j].div(noise[j]).argmax())  # one readback per sampled row
    return token_ids


def _rowwise_filter(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """top-k, then top-p on the renormalised remainder, then min-p; probs [S, V]."""
    S, V = probs.shape
    device = probs.device
    sorted_probs, order = probs.sort(dim=-1, descending=True)  # [S, V]
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)  # [S, V]
    ranks = torch.arange(V, device=device)[None, :]  # [1, V]
    keep &= ranks < torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)[:, None]
    after_k = sorted_probs * keep
    after_k = after_k / after_k.sum(dim=-1, keepdim=True)
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)[:, None]  # [S, 1]
    keep &= (after_k.cumsum(dim=-1) - after_k) < top_p
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)[:, None]  # [S, 1]
    keep &= sorted_probs >= min_p * sorted_probs[:, :1]
    keep[:, 0] = True
    filtered = torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)


# ----------------------------------------------------------------------------- measuring


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class PairedTiming:
    """Both paths over one logits tensor."""

    per_row_s: float  # median seconds of rowwise_sample
    one_tensor_s: float  # median seconds of sample_batch_device + one Readback.fetch
    syncs_before: int  # readbacks rowwise_sample made, counted
    syncs_after: int  # readbacks the one-tensor path made, counted
    token_ids: list[int]  # what both drew (they are checked equal)


def time_pair(logits: torch.Tensor, params: list[SamplingParams], repeats: int, warmup: int,
              seed: int = 0) -> PairedTiming:
    """Times rowwise_sample against the one-tensor path, interleaved, median of `repeats`.

    Both draw from a generator reseeded to `seed` before every call, so sampled rows must agree.

    Raises:
        RuntimeError: the two paths drew different tokens (the comparison would be unfair).
    """
    sampler = BatchedSampler()
    readback = Readback()
    generator = torch.Generator(logits.device)

    def per_row() -> list[int]:
        return rowwise_sample(logits, params, None, generator.manual_seed(seed))

    def one_tensor() -> list[int]:
        return readback.fetch(sampler.sample_batch_device(logits, params, None, generator.manual_seed(seed)))

    with readbacks_counted(forbid=()) as counts:
        before = per_row()
    syncs_before = sum(counts.values())
    with readbacks_counted(forbid=()) as counts:
        after = one_tensor()
    syncs_after = sum(counts.values())
    if before != after:
        row = next(i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b)
        raise RuntimeError(f"per-row and one-tensor sampling disagree at row {row}: {before[row]} vs {after[row]}")

    times: dict[str, list[float]] = {"per_row": [], "one_tensor": []}
    paths = {"per_row": per_row, "one_tensor": one_tensor}
    for i in range(warmup + repeats):
        order = ("per_row", "one_tensor") if i % 2 == 0 else ("one_tensor", "per_row")  # no order bias
        for name in order:
            _sync(logits.device)
            start = time.perf_counter()
            paths[name]()
            elapsed = time.perf_counter() - start
            if i >= warmup:
                times[name].append(elapsed)
    return PairedTiming(statistics.median(times["per_row"]), statistics.median(times["one_tensor"]),
                        syncs_before, syncs_after, before)


@dataclass(frozen=True)
class LiveRun:
    """A short generate on the engine, read from its own counters and recorder."""

    transfers_per_step: float  # Engine.output.transfers_per_step after the run
    journeys: int  # readbacks the engine's Readback counted
    steps: int  # steps the OutputProcessor applied
    sample_s: float  # mean sample phase, decode steps after warm-up
    collect_s: float  # mean collect phase, same steps
    last_logits: torch.Tensor  # [slots, V] logits of the run's last decode step


def live_run(engine: Engine, slots: int, params: SamplingParams, max_tokens: int, warmup: int) -> LiveRun:
    """Generates `slots` requests at once, capturing the logits the sampler saw.

    Raises:
        RuntimeError: the last step did not sample `slots` rows.
    """
    engine.recorder = StepRecorder()
    engine.output.reset()
    captured: list[torch.Tensor] = []
    original = engine._sample

    def capture(logits: torch.Tensor, rows: Any, *rest: Any) -> Any:  # rest: the bitmask and the riders home
        captured[:] = [logits]
        return original(logits, rows, *rest)

    engine._sample = capture  # an instance attribute: step() finds it before the method
    try:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(slots)]
        engine.generate(prompts, dataclasses.replace(params, max_tokens=max_tokens, ignore_eos=True))
    finally:
        del engine._sample
    check_single_transfer(engine.output)  # raises NotSingleTransfer: the loop must read back once a step
    profile = engine.recorder.profile(warmup=warmup, decode_only=True)
    means = profile.phase_means
    logits = captured[0]
    if logits.shape[0] != slots:
        raise RuntimeError(f"the last step sampled {logits.shape[0]} rows, expected {slots}")
    engine.recorder = StepRecorder()  # drop the samples; nothing else reads them
    return LiveRun(engine.output.transfers_per_step, engine.output.readback.journeys, engine.output.num_steps,
                   means["sample"].host_s, means["collect"].host_s, logits.clone())


# ----------------------------------------------------------------------------- the run


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="slots 1 2 4 8 and 8-token engine runs")
    parser.add_argument("--slots", type=int, nargs="+", default=None, help="default 1 2 4 8 16 (1 2 4 8 quick)")
    parser.add_argument("--repeats", type=int, default=25, help="timed calls per path; the median is reported")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per path first")
    parser.add_argument("--engine-tokens", type=int, default=None, help="tokens per live request (16; 8 quick)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="runs/syncbench.csv")
    args = parser.parse_args(argv)
    slots_list = args.slots or ([1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 16])
    engine_tokens = args.engine_tokens or (8 if args.quick else 16)
    live_warmup = 2  # the prefill step and the first decode
    if min(slots_list) < 1:
        parser.error(f"--slots {slots_list}: every slot count must be >= 1")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats={args.repeats} must be >= 1 and --warmup={args.warmup} >= 0")
    if engine_tokens < live_warmup + 2:
        parser.error(f"--engine-tokens={engine_tokens} must be >= {live_warmup + 2}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    max_slots = max(slots_list)
    config = EngineConfig(dtype="float32", quantization=None, max_num_seqs=max_slots, max_model_len=256, num_kv_blocks=max_slots * cdiv(256, 16),
                          device=args.device)
    engine = Engine.from_pretrained(args.model, config)
    vocab = engine.model.config.vocab_size
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (embedded default)"
    live_run(engine, 1, GREEDY, live_warmup + 2, live_warmup)  # uncounted warm-up for the process

    print(f"syncbench: {model_name}, {args.device} {engine.config.dtype}, {torch.get_num_threads()} threads; "
          f"the sample phase over one real [slots, {vocab}] logits tensor from a decode step, "
          f"median of {args.repeats} after {args.warmup} warm-up calls, paths interleaved")
    measurements: list[SyncMeasurement] = []
    live: dict[tuple[int, str], LiveRun] = {}
    expected: dict[tuple[int, str], int] = {}
    for slots in slots_list:
        for label, params in PARAMS.items():
            live[slots, label] = live_run(engine, slots, params, engine_tokens, live_warmup)
        logits = live[slots, "greedy"].last_logits  # one tensor for both parameter sets
        for label, params in PARAMS.items():
            timing = time_pair(logits, [params] * slots, args.repeats, args.warmup)
            measurements.append(SyncMeasurement(slots, label, timing.per_row_s, timing.one_tensor_s,
                                                timing.syncs_before, timing.syncs_after))
            expected[slots, label] = int(syncs_per_step(slots, "per_row", num_greedy=slots if params.is_greedy else 0))
            print(f"  slots {slots} {label}: tokens agree on all {slots} rows", file=sys.stderr)
    print()
    print(render(measurements))
    mismatched = [(m.slots, m.params) for m in measurements
                  if (m.syncs_before, m.syncs_after) != (expected[m.slots, m.params], 1)]
    print(f"syncs counted live match syncs_per_step (per_row before, one_tensor after): "
          f"{'yes, every row' if not mismatched else f'NO at {mismatched}'}")

    print()
    print("the loop as the engine runs it (live, from Engine.output and the StepRecorder; decode steps):")
    print(f"{'slots':<8}{'params':<9}{'transfers/step':>15}{'journeys/steps':>16}{'sample':>12}{'collect':>12}")
    for (slots, label), run in live.items():
        print(f"{slots:<8}{label:<9}{run.transfers_per_step:>15.2f}{f'{run.journeys}/{run.steps}':>16}"
              f"{run.sample_s * 1e3:>10.3f}ms{run.collect_s * 1e3:>10.3f}ms")

    per_transfer_s = measure_transfer_s(args.device, n=101, rows=max_slots)
    print()
    try:
        check_measurable(per_transfer_s, args.device)
    except NotMeasurable as refusal:
        priced = False
        print(f"check_measurable refuses: {refusal}")
        print("  so the sync saving (the 'syncs before/after' column) is not priced here: on this machine "
              "the 'faster' column is the Python saving alone, and the sync saving is zero by construction.")
    else:
        priced = True
        print(f"one readback costs {per_transfer_s * 1e6:.2f}us on {args.device}")

    rows = []
    for m in measurements:
        run = live[m.slots, m.params]
        greedy = PARAMS[m.params].is_greedy
        saving = saving_per_step(m.slots, per_transfer_s, num_greedy=m.slots if greedy else 0) if priced else None
        rows.append({
            "slots": m.slots,
            "params": m.params,
            "vocab": vocab,
            "repeats": args.repeats,
            "per_row_ms": m.per_row_s * 1e3,
            "one_tensor_ms": m.one_tensor_s * 1e3,
            "speedup_x": m.speedup,
            "syncs_before": m.syncs_before,
            "syncs_after": m.syncs_after,
            "syncs_before_predicted": expected[m.slots, m.params],
            "engine_transfers_per_step": run.transfers_per_step,
            "engine_readback_journeys": run.journeys,
            "engine_steps": run.steps,
            "engine_sample_ms": run.sample_s * 1e3,
            "engine_collect_ms": run.collect_s * 1e3,
            "per_transfer_us": per_transfer_s * 1e6,
            "sync_saving_per_step_ms": "" if saving is None else saving * 1e3,
            "sync_saving_priced": priced,
            "threads": torch.get_num_threads(),
            "device": args.device,
            "date": time.strftime("%Y-%m-%d"),
        })
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")
    return 0 if not mismatched else 1


if __name__ == "__main__":
    sys.exit(main())
