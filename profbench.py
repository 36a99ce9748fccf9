"""profbench: one decode step taken apart, per slot count, on real weights.

For each slot count B the engine serves B identical-shape requests at once (greedy, EOS ignored,
fixed prompt and output length) with a StepRecorder attached. The first steps are dropped as
warm-up and only pure decode steps are kept, so every measured step has exactly B rows. The
table is the mean step, its forward, the loop around the forward (schedule + sync_rows +
build_inputs + sample + collect), the loop per token and the loop's share of the step, then each
phase's mean. One CSV row per slot count, units in the column names.

What a CPU can and cannot say is printed, not assumed: the loop is told apart from the forward by
name, so loop_overhead_s survives having no accelerator, and step_with_compute projects a step
with some other forward under this loop (a projection, valid down one row only). Pricing an
optimisation needs a device clock, so check_device_timed refuses on a CPU and the refusal is shown.

    python profbench.py            # slots 1 2 4 8 16, 32 output tokens
    python profbench.py --quick    # slots 1 2 4, 12 output tokens: well under a minute
    python profbench.py --structured 1 16   # also 1 and 16 of 16 slots held to a JSON schema

With --structured N, N of the slots are held to STRUCTURED_SCHEMA, so each decode step also fills
the grammar bitmask on the host (the grammar_mask phase, one row per constrained slot) and masks
the logits in sample: the table gives the fill's host time per step and per constrained row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.params import StructuredOutputs
from nanoserve.profiler import (
    FORWARD,
    PHASES,
    CudaEventTimer,
    NotDeviceTimed,
    StepProfile,
    StepRecorder,
    check_accounted,
    check_device_timed,
    check_warmed_up,
    loop_overhead_s,
    null_recorder_cost_s,
    recommended_model,
    render,
    render_sweep,
    speedup_if,
    step_recorder_cost_s,
    step_with_compute,
)
from nanoserve.scheduler import cdiv

# Any text will do: it is encoded once and cut or repeated to exactly --prompt-tokens tokens.
PROMPT_TEXT = (
    "The engine loop schedules requests, builds the inputs, runs the forward pass, samples one token "
    "per row and hands each token back to the request that owns it."
)

# Pets as a JSON array that cannot end within any run (minItems): a constrained request walks keys,
# strings, integers and enums for every one of its tokens and never stops before the others.
STRUCTURED_SCHEMA = {"type": "array", "minItems": 1000, "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}, "kind": {"enum": ["cat", "dog", "fish"]}},
    "required": ["name", "age", "kind"]}}
GRAMMAR_MASK = "grammar_mask"  # the engine's phase that fills the bitmask


@dataclass(frozen=True)
class SlotProfile:
    """One slot count's measured steps and what the bench derived from them."""

    slots: int  # requests served at once (= rows per decode step)
    profile: StepProfile  # decode steps only, warm-up dropped
    wall_s: float  # seconds the whole generate call took, prefill included
    constrained: int = 0  # of the slots, how many were held to STRUCTURED_SCHEMA


def make_prompt(tokenizer: Any, num_tokens: int) -> list[int]:
    """PROMPT_TEXT's token ids, repeated and cut to exactly num_tokens.

    Raises:
        ValueError: num_tokens < 1.
    """
    if num_tokens < 1:
        raise ValueError(f"prompt length {num_tokens} must be >= 1")
    ids = tokenizer.encode(PROMPT_TEXT)
    return (ids * cdiv(num_tokens, len(ids)))[:num_tokens]


def profile_slots(
    engine: Engine,
    slots: int,
    prompt_ids: list[int],
    output_tokens: int,
    warmup: int,
    threads: int | None,
    constrained: int = 0,
) -> SlotProfile:
    """Serves `slots` requests at once on a fresh engine over `engine`'s model and profiles it;
    the first `constrained` of them are held to STRUCTURED_SCHEMA.

    Raises:
        RuntimeError: a request came back short, or a kept step did not have `slots` rows (the
            profile would then not stand for this slot count).
    """
    block_size = 16
    max_len = len(prompt_ids) + output_tokens
    config = EngineConfig(
        block_size=block_size,
        num_kv_blocks=slots * cdiv(max_len, block_size),  # exactly enough: no preemption, no waste
        max_num_seqs=slots,
        max_num_batched_tokens=max(2048, slots * len(prompt_ids)),  # every prompt in one step
        max_model_len=max_len,
        device=engine.config.device,
        dtype=engine.plan.dtype,  # the model is laid out already: the same precision, nothing redone
        quantization=engine.config.quantization,
    )
    bench = Engine(engine.model, engine.tokenizer, config)
    timer = CudaEventTimer() if bench.device.type == "cuda" else None
    bench.recorder = StepRecorder(device_timer=timer)
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    structured = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True,
                                structured_outputs=StructuredOutputs(json=STRUCTURED_SCHEMA))
    start = time.perf_counter()
    outputs = bench.generate([prompt_ids] * slots, [structured] * constrained + [params] * (slots - constrained))
    wall_s = time.perf_counter() - start
    short = [o.request_id for o in outputs if len(o.token_ids) != output_tokens]
    if short:
        raise RuntimeError(f"requests {short} returned fewer than {output_tokens} tokens")
    profile = bench.recorder.profile(warmup=warmup, decode_only=True)
    rows = {s.num_rows for s in profile.samples}
    if rows != {slots}:
        raise RuntimeError(f"kept steps had {sorted(rows)} rows; every one must have {slots}")
    check_warmed_up(profile, warmup)  # raises NotWarmedUp
    check_accounted(profile)  # raises Unaccounted: phases must add up to the steps
    return SlotProfile(slots, profile, wall_s, constrained)


def _ms(seconds: float) -> float:
    return seconds * 1e3


def phase_table(results: Sequence[SlotProfile]) -> str:
    """Each phase's mean host time per slot count, plus sample's share of the loop."""
    header = f"{'slots':<6}" + "".join(f"{name:>14}" for name in PHASES) + f"{'sample/loop':>13}"
    lines = [header]
    for r in results:
        means = r.profile.phase_means
        cells = "".join(f"{_ms(means[name].host_s) if name in means else 0.0:>12.3f}ms" for name in PHASES)
        loop = loop_overhead_s(r.profile)
        sample = means["sample"].host_s if "sample" in means else 0.0
        lines.append(f"{r.slots:<6}{cells}{sample / loop if loop > 0 else 0.0:>13.1%}")
    return "\n".join(lines)


def csv_row(
    r: SlotProfile,
    *,
    prompt_tokens: int,
    output_tokens: int,
    warmup: int,
    project_forward_s: float,
    null_cost_s: float,
    recorder_cost_s: float,
    device: str,
) -> dict[str, Any]:
    """One CSV row: units in the column names, projections labelled as projections."""
    p = r.profile
    means = p.phase_means
    loop = loop_overhead_s(p)
    row: dict[str, Any] = {
        "slots": r.slots,
        "requests": r.slots,
        "constrained_rows": r.constrained,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "warmup_steps": warmup,
        "decode_steps": p.num_steps,
        "step_ms": _ms(p.step_s),
        "forward_ms": _ms(means[FORWARD].host_s),
        "loop_ms": _ms(loop),
        "loop_per_token_ms": _ms(loop_overhead_s(p, per_token=True)),
        "loop_share_pct": 100.0 * loop / p.step_s,
    }
    for name in (*PHASES, GRAMMAR_MASK):
        if name != FORWARD:
            row[f"{name}_ms"] = _ms(means[name].host_s) if name in means else 0.0
    row |= {
        "sample_loop_share_pct": 100.0 * means["sample"].host_s / loop if loop > 0 else 0.0,
        "accounted_pct": 100.0 * p.accounted_s / p.step_s,
        "sync_points": p.sync_points,
        "overlap_model": recommended_model(p),
        "device_timed": p.is_device_timed,
        "projected_forward_ms": _ms(project_forward_s),
        "projected_step_ms": _ms(step_with_compute(p, project_forward_s)),
        "wall_s": r.wall_s,
        "null_recorder_us_per_step": null_cost_s * 1e6,
        "step_recorder_us_per_step": recorder_cost_s * 1e6,
        "threads": torch.get_num_threads(),
        "device": device,
        "date": time.strftime("%Y-%m-%d"),
    }
    return row


def grammar_table(results: Sequence[SlotProfile], plain: dict[int, SlotProfile]) -> str:
    """The bitmask fill's mean host time per step and per constrained row, beside the sample phase
    (which applies the mask) and the same slot count's unconstrained sample, when it was run."""
    lines = [f"{'slots':<6}{'constrained':>12}{'mask fill/step':>16}{'per row':>10}{'sample':>10}"
             f"{'unconstrained sample':>22}{'step':>10}"]
    for r in results:
        means = r.profile.phase_means
        fill = means[GRAMMAR_MASK].host_s if GRAMMAR_MASK in means else 0.0
        base = plain.get(r.slots)
        base_sample = f"{_ms(base.profile.phase_means['sample'].host_s):.3f}ms" if base else "not run"
        lines.append(f"{r.slots:<6}{r.constrained:>12}{_ms(fill):>14.3f}ms{fill / r.constrained * 1e6:>8.1f}us"
                     f"{_ms(means['sample'].host_s):>8.3f}ms{base_sample:>22}{_ms(r.profile.step_s):>8.3f}ms")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: embedded SmolLM2-135M)")
    parser.add_argument("--quick", action="store_true", help="slots 1 2 4, 12 output tokens")
    parser.add_argument("--slots", type=int, nargs="+", default=None, help="slot counts (default 1 2 4 8 16)")
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=None, help="default 32 (12 with --quick)")
    parser.add_argument("--warmup", type=int, default=2, help="leading steps dropped (the prefill is one)")
    parser.add_argument("--project-forward-ms", type=float, default=2.0,
                        help="forward substituted by step_with_compute (a projection)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto", help="EngineConfig.dtype (default auto: the probe chooses)")
    parser.add_argument("--quantization", default="auto", help="EngineConfig.quantization: auto, int8, int4 or none")
    parser.add_argument("--structured", type=int, nargs="+", default=[], metavar="N",
                        help="also profile, for each N, the largest slot count with N of its slots held to a JSON "
                             "schema (the grammar bitmask's cost per step)")
    parser.add_argument("--out", default="runs/profbench.csv")
    args = parser.parse_args(argv)
    slots_list = args.slots or ([1, 2, 4] if args.quick else [1, 2, 4, 8, 16])
    output_tokens = args.output_tokens or (12 if args.quick else 32)
    for name, value, low in (("--prompt-tokens", args.prompt_tokens, 1), ("--warmup", args.warmup, 1),
                             ("--output-tokens", output_tokens, args.warmup + 2)):
        if value < low:
            parser.error(f"{name}={value} must be >= {low}")  # output: warm-up plus 2 kept decode steps
    if min(slots_list) < 1:
        parser.error(f"--slots {slots_list}: every slot count must be >= 1")
    if args.structured and not all(1 <= n <= max(slots_list) for n in args.structured):
        parser.error(f"--structured {args.structured}: each N must be in [1, {max(slots_list)}] (the largest slot count)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    quantization = None if args.quantization == "none" else args.quantization
    engine = Engine.from_pretrained(args.model, EngineConfig(device=args.device, dtype=args.dtype,
                                                             quantization=quantization))
    model_name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (embedded default)"
    prompt_ids = make_prompt(engine.tokenizer, args.prompt_tokens)
    # Uncounted warm-up for the process (allocator growth, first-call dispatch), on top of the
    # per-run warm-up steps the profile drops.
    profile_slots(engine, 1, prompt_ids, args.warmup + 2, args.warmup, args.threads)

    print(f"profbench: {model_name}, {args.device} {engine.plan.dtype} quantization "
          f"{engine.plan.quantization} ({engine.plan.reason}), {torch.get_num_threads()} threads; "
          f"B requests x {output_tokens} tokens on a {args.prompt_tokens}-token prompt, greedy, EOS ignored; "
          f"{args.warmup} warm-up steps dropped, decode steps only")
    results = []
    for slots in slots_list:
        results.append(profile_slots(engine, slots, prompt_ids, output_tokens, args.warmup, args.threads))
        print(f"  slots {slots}: {results[-1].profile.num_steps} decode steps kept, "
              f"{results[-1].wall_s:.2f} s wall", file=sys.stderr)
    structured = []
    for n in args.structured:
        structured.append(profile_slots(engine, max(slots_list), prompt_ids, output_tokens, args.warmup, args.threads, n))
        print(f"  slots {max(slots_list)}, {n} constrained: {structured[-1].profile.num_steps} decode steps kept, "
              f"{structured[-1].wall_s:.2f} s wall", file=sys.stderr)
    print()
    print(render_sweep({r.slots: r.profile for r in results}))
    print()
    print("mean host time per phase:")
    print(phase_table(results))
    for r in results:
        print()
        print(f"slots {r.slots}:")
        print(render(r.profile))

    project_s = args.project_forward_ms / 1e3
    print()
    print("what this machine can honestly say:")
    for r in results:
        p = r.profile
        print(f"  slots {r.slots}: loop_overhead_s {_ms(loop_overhead_s(p)):.3f}ms "
              f"({_ms(loop_overhead_s(p, per_token=True)):.3f}ms per token); projection: a "
              f"{args.project_forward_ms:g}ms forward under this loop is a "
              f"{_ms(step_with_compute(p, project_s)):.3f}ms step ({recommended_model(p)} model)")
    print("  loop per token is the column comparable across slot counts; one projected forward cannot "
          "stand for every batch size, so the projections compare only down their own row.")
    for r in results:
        try:
            check_device_timed(r.profile)
        except NotDeviceTimed as refusal:
            print(f"  check_device_timed refuses (slots {r.slots}): {refusal}")
        else:
            p = r.profile
            print(f"  slots {r.slots}: ceiling with every overhead removed "
                  f"{speedup_if(p, overhead_factor=float('inf')):.2f}x; "
                  f"without the sample phase {speedup_if(p, eliminate=('sample',)):.2f}x")

    n = 20_000 if args.quick else 200_000
    null_cost = null_recorder_cost_s(n)
    recorder_cost = step_recorder_cost_s(n)
    loop_1 = loop_overhead_s(results[0].profile)
    print()
    print(f"instrument cost per step (begin, six empty phases, end; mean of {n} steps): "
          f"NULL_RECORDER {null_cost * 1e6:.2f}us, StepRecorder {recorder_cost * 1e6:.2f}us "
          f"({recorder_cost / null_cost:.1f}x); against the slots-{results[0].slots} loop of "
          f"{_ms(loop_1):.3f}ms: {null_cost / loop_1:.2%} and {recorder_cost / loop_1:.2%}")

    if structured:
        print()
        print("structured outputs: the grammar bitmask filled on the host each step, mean per step:")
        print(grammar_table(structured, {r.slots: r for r in results}))

    rows = [csv_row(r, prompt_tokens=args.prompt_tokens, output_tokens=output_tokens, warmup=args.warmup,
                    project_forward_s=project_s, null_cost_s=null_cost, recorder_cost_s=recorder_cost,
                    device=args.device) for r in results + structured]
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
