"""abbench: one engine change, measured as a pair. Decode steps of a ragged batch are timed with
the change off (A) and on (B), alternating A B A B ... in one process, and reported as a ratio.

    python benchmarks/abbench.py --change groups     # length-grouped decode attention
    python benchmarks/abbench.py --change deferred   # deferred output processing
    python benchmarks/abbench.py --change compile    # torch.compile of the decoder layer against packed eager (warm-up apart)
    python benchmarks/abbench.py --change packed     # matmul weights packed for oneDNN against plain F.linear
    python benchmarks/abbench.py --change fused      # the decode glue in C (fused_decode) against decoder_layer
    python benchmarks/abbench.py --change int16      # blockdot's int16 path against its float32 path
    python benchmarks/abbench.py --change dequantize # wide steps on panels dequantized per call against dense copies
    python benchmarks/abbench.py --change dense      # dense matrices on blockdot's dense panels against torch's (oneDNN)
    python benchmarks/abbench.py --change kv16       # a float16 K/V cache against the model's dtype's
    python benchmarks/abbench.py --change per-layer --slots 16 32   # the per-layer C glue against decoder_layer
    python benchmarks/abbench.py --change invariant  # the batch-invariant plan against the fastest one
    python benchmarks/abbench.py --change invariant --phase prefill --slots 1 4 --prompt-range 512 512

--phase prefill times the steps that prefill the prompts (each slot's whole prompt, several
prompts a step) in place of the decode steps that follow.

Every change but fused, kv16 and int16 runs the default model in float32, dense; fused and kv16 run
it at the default precision (the GGUF's blocks on the kernels the probe picks, and their dense
copies), both engines over the same laid-out weights (kv16: EngineConfig.kv_cache_dtype "float16"
against "auto"); int16 too, each engine laying the file's blocks out itself
(PlanOverrides.blockdot_int16_rows 1 against None); dequantize the same way (PlanOverrides.dense_copies
False against True). packed and compile measure torch's dense linears (PlanOverrides.dense_kernel
"torch" on both sides); dense puts them against blockdot's dense panels ("torch" against "blockdot").
per-layer lays the file's blocks out on each side with max_kernel_rows 8, so that decode steps of
more than 8 rows take the plan's c-per-layer driver (three C calls a layer between the linears) on
B and decoder_layer on A (PlanOverrides.fused_decode True against False). invariant lays the file's
blocks out on each side at the default precision, EngineConfig.batch_invariant True against False
(every step in one C call at every width, prompts too, against prompts on torch's matmuls past 64
rows); every other change measures its engines with batch_invariant False, the plan it was built for.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from nanoserve import Engine, EngineConfig, PlanOverrides, SamplingParams
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.model.weights import load_checkpoint

CHANGES = ("groups", "deferred", "compile", "packed", "fused", "int16", "dequantize", "dense", "kv16", "per-layer",
           "invariant")


def make_engine(base: Engine, change: str, on: bool, slots: int) -> Engine:
    """An engine over `base`'s plain weights with `change` off (A) or on (B), every other setting equal.
    Each engine prepares its own model from them (packed or compiled), so A and B never share a change.
    Compile is measured against the best eager engine, the packed one; packing against plain. fused:
    `base` is at the default precision, laid out already; both engines run its weights as they are."""
    if change in ("fused", "kv16"):
        setting = ({"overrides": PlanOverrides(fused_decode=on)} if change == "fused"
                   else {"kv_cache_dtype": "float16" if on else "auto"})
        return Engine(base.model, base.tokenizer, EngineConfig(
            dtype=base.plan.dtype, quantization="auto", max_num_seqs=slots, max_model_len=2048,
            max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False,
            batch_invariant=False, **setting))
    if change in ("int16", "dequantize", "per-layer", "invariant"):
        pinned = {"int16": {"blockdot_int16_rows": 1 if on else None}, "dequantize": {"dense_copies": not on},
                  "per-layer": {"fused_decode": on, "max_kernel_rows": 8}, "invariant": {}}[change]
        return Engine(base.model, base.tokenizer, EngineConfig(
            max_num_seqs=slots, max_model_len=2048, max_num_batched_tokens=8192, kv_cache_memory_bytes=1 << 30,
            enable_prefix_caching=False, batch_invariant=on and change == "invariant",
            overrides=PlanOverrides(**pinned)))
    packed = {"packed": on, "compile": not on}.get(change, True)
    dense_kernel = {"packed": "torch", "compile": "torch", "dense": "blockdot" if on else "torch"}.get(change, "auto")
    config = EngineConfig(dtype="float32", quantization=None, max_num_seqs=slots, max_model_len=2048, max_num_batched_tokens=8192,
                          kv_cache_memory_bytes=1 << 30, enable_prefix_caching=False,
                          deferred_output=(change == "deferred" and on), compile=(change == "compile" and on),
                          batch_invariant=False, overrides=PlanOverrides(pack_weights=packed, dense_kernel=dense_kernel))
    if change == "groups" and not on:  # decode rows attended as one group, never split by length
        config = dataclasses.replace(config, decode_group_min_rows=None)
    return Engine(base.model, base.tokenizer, config)


def step_times(engine: Engine, prompts: list[list[int]], steps: int, phase: str = "decode") -> list[float]:
    """Admits every prompt and times the steps that prefill them (phase "prefill"), or finishes the
    prefills and times `steps` decode steps."""
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True))
    times = []
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    if phase == "decode":
        times = []
        engine.step()
    for _ in range(steps if phase == "decode" else 0):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for rid in list(engine.requests):
        engine.abort(rid)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--change", choices=CHANGES, required=True)
    parser.add_argument("--model", default=None)
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=[32, 512])
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.change in ("fused", "kv16"):
        base = Engine.from_pretrained(args.model, EngineConfig(max_model_len=2048, batch_invariant=False,
                                                               overrides=PlanOverrides(fused_decode=args.change == "kv16")))
    elif args.change in ("int16", "dequantize", "per-layer", "invariant"):  # the checkpoint as loaded: each engine lays it out
        model, tokenizer = load_checkpoint(args.model, "cpu", max_positions=2048)
        base = SimpleNamespace(model=model, tokenizer=tokenizer)
    else:
        base = Engine.from_pretrained(args.model, EngineConfig(
            dtype="float32", quantization=None, max_model_len=2048,
            overrides=PlanOverrides(pack_weights=False, dense_kernel="torch")))
    rng = random.Random(0)
    vocab = base.model.config.vocab_size
    rows = []
    print(f"abbench --change {args.change}: {args.phase} steps, ragged prompts {args.prompt_range}, "
          f"{args.rounds} rounds of A B, {args.steps} steps each, median per step")
    print(f"{'slots':>5}{'A (off) ms':>12}{'B (on) ms':>11}{'B / A':>8}{'warm-up B s':>13}{'per round':>17}")
    for slots in args.slots:
        prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(*args.prompt_range))] for _ in range(slots)]
        engines = {on: make_engine(base, args.change, on, slots) for on in (False, True)}
        warmup = {on: engines[on].warmup() for on in (False, True)}
        samples: dict[bool, list[float]] = {False: [], True: []}
        ratios = []  # each round's B / A, the pair run back to back: the spread
        for _ in range(args.rounds):
            medians = {}
            for on in (False, True):
                measured = step_times(engines[on], prompts, args.steps, args.phase)
                samples[on] += measured
                medians[on] = statistics.median(measured)
            ratios.append(medians[True] / medians[False])
        a, b = statistics.median(samples[False]), statistics.median(samples[True])
        rows.append({"change": args.change, "phase": args.phase, "slots": slots, "a_step_ms": a * 1e3, "b_step_ms": b * 1e3,
                     "b_over_a": b / a, "round_ratio_min": min(ratios), "round_ratio_max": max(ratios),
                     "b_warmup_s": warmup[True]})
        print(f"{slots:>5}{a * 1e3:>12.1f}{b * 1e3:>11.1f}{b / a:>7.2f}x{warmup[True]:>13.1f}"
              f"{min(ratios):>10.2f} - {max(ratios):.2f}")
    out = Path(args.out or f"runs/abbench-{args.change}{'-prefill' if args.phase == 'prefill' else ''}.csv")
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
