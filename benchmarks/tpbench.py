"""tpbench: tensor parallelism measured on this machine, and priced for a GPU node.

1. measured: TP=1 against TP=2 (gloo, two local processes) on the same checkpoint and precision:
   the time of a decode step at 1, 4 and 16 slots and of one prefill step, the pair interleaved by
   round. TP=1 runs with every core this process may use, each TP=2 rank with its share (cores //
   2). Per step, from rank 0's counters: the all-reduces (count, bytes, host time), the logits'
   gather and the plan's broadcast. The two engines' greedy tokens are checked equal first; a
   comparison of engines that disagree is refused.
2. computed: the all-reduce time a step would take at TP=2, 4 and 8 on an 8-GPU NVLink node
   (H100/H200), from nccl-tests' cost of an all-reduce, t = alpha + (S / busbw) * 2 (n - 1) / n
   (doc/PERFORMANCE.md in NVIDIA/nccl-tests), with published figures bracketing alpha and busbw
   (GPU_FIGURES, each with its source), for this model's all-reduces: 2 a layer, T x E x 4 bytes each.

    python benchmarks/tpbench.py               # the default model, float32, 20 timed steps a point
    python benchmarks/tpbench.py --quick       # 3 timed steps a point, slots 1 and 4
    python benchmarks/tpbench.py --dtype auto --quantization auto --pair plans
        # TP=2 on torch's kernels (batch_invariant=False) against TP=2 on the batch-invariant plan
        # (each rank's slices on blockdot's or dense panels, C glue, partials summed in rank order)

Engines that answer differently are not compared where they should agree (TP=1 and TP=2 of one
plan: refused); two plans that round differently are compared, with each one's greedy agreement
with float32 (the exact path, one process) and with the other printed and written beside their times.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.model.config import LlamaConfig
from nanoserve.parallel import TensorParallelModel

# Published figures for an 8-GPU NVLink 4 node. H200 and H100 SXM share NVLink 4: 900 GB/s a GPU
# both ways, 450 GB/s each way (NVIDIA's H100 and H200 datasheets).
GPU_FIGURES = {
    # Small-message all-reduce latency, microseconds, by GPU count: a bracket.
    # low: HGX 8x H100, NCCL 2.20.5, NVLSTree, CUDA graphs, 2 GPUs: "approximately 6us"
    #      (github.com/NVIDIA/nccl/issues/1259), taken for every n (optimistic: it grows with n).
    # high: ring, one channel, DGX A100: 10.0 us at 2 GPUs, 16.88 at 4, 33.7 at 8
    #      (github.com/NVIDIA/nccl-tests/issues/123): NCCL's ring latency, pessimistic for H100.
    "alpha_us_low": {2: 6.0, 4: 6.0, 8: 6.0},
    "alpha_us_high": {2: 10.0, 4: 16.88, 8: 33.7},
    # Large-message bus bandwidth, GB/s: ring 365-370 on 8x H100 SXM from 2 to 8 GPUs, NVLS up to
    # 480 at 8 (github.com/NVIDIA/nccl/issues/1455; 480 is GTC S62129's figure, NVIDIA/nccl #1374).
    "busbw_gbps_low": 365.0,
    "busbw_gbps_high": 480.0,
    # HBM bandwidth of one H200, TB/s (NVIDIA H200 datasheet): a step's weight reads, for scale.
    "hbm_tbps": 4.8,
}


def prompt(engine: Engine, length: int, seed: int) -> list[int]:
    """A fixed prompt of `length` token ids inside the model's vocabulary (above its special ids)."""
    vocab = engine.model.config.vocab_size
    return [(seed * 7919 + 31 * j) % (vocab - 10) + 10 for j in range(length)]


def counters(engine: Engine) -> dict[str, float]:
    """Rank 0's collective counters (CollectiveStats) of a TP engine; {} for one process."""
    model = engine.model
    return dataclasses.asdict(model.group.stats) if isinstance(model, TensorParallelModel) else {}


def decode_steps(engine: Engine, slots: int, prompt_len: int, steps: int) -> tuple[list[float], dict[str, float]]:
    """Seconds of each of `steps` decode steps with `slots` requests running (their prefill
    untimed), and what the counters counted over those steps."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request(prompt(engine, prompt_len, i), params) for i in range(slots)]
    while any(r.num_computed_tokens < prompt_len for r in engine.requests.values()):
        engine.step()
    before, times = counters(engine), []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    after = counters(engine)
    for request_id in ids:
        engine.abort(request_id)
    return times, {k: after[k] - before[k] for k in after}


def prefill_step(engine: Engine, prompt_len: int) -> tuple[list[float], dict[str, float]]:
    """Seconds of the one step that prefills a `prompt_len`-token prompt, and its counts."""
    request_id = engine.add_request(prompt(engine, prompt_len, 99),
                                    SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    before = counters(engine)
    start = time.perf_counter()
    engine.step()
    elapsed = time.perf_counter() - start
    after = counters(engine)
    engine.abort(request_id)
    return [elapsed], {k: after[k] - before[k] for k in after}


def measured_rows(pair: list[tuple[str, Engine]], points: list[tuple[str, int]], steps: int, rounds: int,
                  prompt_len: int, alike: dict[str, dict[str, float]]) -> list[dict]:
    """Step times of the pair [(label, engine)], interleaved by round; alike: by label, the engine's
    greedy agreements (column -> share), written beside its times."""
    cores = len(os.sched_getaffinity(0))
    samples: dict[tuple[str, int, str], list[float]] = {}
    counted: dict[tuple[str, int, str], dict[str, float]] = {}
    for _ in range(rounds):
        for label, engine in pair:
            torch.set_num_threads(threads_of(engine, cores))  # process-wide: TP=1 gets every core, rank 0 its share
            for kind, size in points:
                times, delta = decode_steps(engine, size, prompt_len, steps) if kind == "decode" \
                    else prefill_step(engine, size)
                samples.setdefault((kind, size, label), []).extend(times)
                total = counted.setdefault((kind, size, label), {})
                for k, v in delta.items():
                    total[k] = total.get(k, 0.0) + v
    engines = dict(pair)
    rows = []
    for (kind, size, label), times in samples.items():
        engine = engines[label]
        tp = engine.config.tensor_parallel_size
        row = {"bench": "measured", "workload": kind, "slots_or_prompt_tokens": size, "engine": label, "tp": tp,
               "driver": engine.plan.driver(size, kind == "decode"), "batch_invariant": engine.plan.is_batch_invariant,
               "threads_per_rank": threads_of(engine, cores), "timed_steps": len(times),
               "step_ms_median": 1e3 * statistics.median(times), "step_ms_min": 1e3 * min(times), **alike[label]}
        if tp == 2:
            c, n = counted[(kind, size, label)], len(times)
            row |= {"all_reduces_per_step": c["num_all_reduces"] / n, "all_reduce_bytes_per_step": c["all_reduce_bytes"] / n,
                    "all_reduce_ms_per_step": 1e3 * c["all_reduce_s"] / n,
                    "gather_bytes_per_step": c["gather_bytes"] / n, "gather_ms_per_step": 1e3 * c["gather_s"] / n,
                    "plan_bytes_per_step": c["plan_bytes"] / n, "plan_ms_per_step": 1e3 * c["plan_s"] / n}
        rows.append(row)
    return rows


def gpu_rows(config: LlamaConfig, tokens: list[int], element_bytes: int = 4) -> list[dict]:
    """The all-reduce time per step at TP=2/4/8 on the node GPU_FIGURES describes (arithmetic)."""
    f = GPU_FIGURES
    weight_bytes = 2 * config.num_params  # bf16 weights
    rows = []
    for n in (2, 4, 8):
        for T in tokens:
            size = T * config.hidden_size * element_bytes  # one all-reduce's tensor, S
            per_step = 2 * config.num_layers
            factor = 2 * (n - 1) / n
            low = f["alpha_us_low"][n] + 1e6 * size / (f["busbw_gbps_high"] * 1e9) * factor
            high = f["alpha_us_high"][n] + 1e6 * size / (f["busbw_gbps_low"] * 1e9) * factor
            rows.append({"bench": "gpu_model", "tp": n, "tokens_per_step": T, "all_reduces_per_step": per_step,
                         "all_reduce_bytes": size, "all_reduce_bytes_per_step": per_step * size,
                         "all_reduce_us_low": low, "all_reduce_us_high": high,
                         "all_reduce_us_per_step_low": per_step * low, "all_reduce_us_per_step_high": per_step * high,
                         "weight_read_us_per_step": 1e6 * weight_bytes / n / (f["hbm_tbps"] * 1e12)})
    return rows


def threads_of(engine: Engine, cores: int) -> int:
    return max(1, cores // engine.config.tensor_parallel_size)


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of thermodynamics are",
           "Water boils at", "List three prime numbers:", "import numpy as np", "The quick brown fox"]
ANSWER_TOKENS = 24


def answers(engine: Engine) -> list[list[int]]:
    """Greedy tokens for PROMPTS; also a warm-up (the engine has run every shape once)."""
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS, ignore_eos=True)
    return [list(o.token_ids) for o in engine.generate(PROMPTS, params)]


def agreement(xs: list[list[int]], ys: list[list[int]]) -> float:
    """The share of the answers' tokens before each pair's first difference (quantbench's greedy
    agreement: mean common prefix over the answer length)."""
    prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), ANSWER_TOKENS)
              for a, b in zip(xs, ys, strict=True)]
    return sum(prefix) / (ANSWER_TOKENS * len(prefix))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint (default: the embedded default model's GGUF)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps a point, a round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the pair interleaved in each")
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens of the decoding requests")
    parser.add_argument("--prefill", type=int, default=512, help="prompt tokens of the timed prefill step")
    parser.add_argument("--quantization", default="none", choices=["none", "auto", "int4"],
                        help="the engines' quantization (auto: a GGUF's blocks as stored where a kernel runs them)")
    parser.add_argument("--batch-invariant", default="auto", choices=["auto", "true", "false"],
                        help="the engines' batch_invariant (float32 with quantization none is the exact path under auto)")
    parser.add_argument("--pair", default="tp", choices=["tp", "plans"],
                        help="tp: TP=1 against TP=2; plans: TP=2 with batch_invariant=False against TP=2 as configured")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="runs/tpbench.csv")
    args = parser.parse_args()
    slots = [1, 4] if args.quick else [1, 4, 16]
    steps, rounds = (3, 1) if args.quick else (args.steps, args.rounds)
    torch.manual_seed(0)
    invariant = {"auto": "auto", "true": True, "false": False}[args.batch_invariant]
    config = {"dtype": args.dtype, "quantization": None if args.quantization == "none" else args.quantization,
              "num_kv_blocks": 512, "max_num_seqs": max(slots), "max_num_batched_tokens": max(2048, args.prefill),
              "batch_invariant": invariant}
    path = Path(args.model) if args.model else None
    first = EngineConfig(**config, tensor_parallel_size=1) if args.pair == "tp" else \
        EngineConfig(**config | {"batch_invariant": False}, tensor_parallel_size=2)
    labels = ("TP=1", "TP=2") if args.pair == "tp" else ("TP=2 not invariant", "TP=2 as configured")
    exact = config | {"dtype": "float32", "quantization": None, "batch_invariant": "auto"}
    with Engine.from_pretrained(path, EngineConfig(**exact)) as reference:  # the exact path: float32's tokens
        float32 = answers(reference)
    with Engine.from_pretrained(path, first) as a, \
            Engine.from_pretrained(path, EngineConfig(**config, tensor_parallel_size=2)) as b:
        assert isinstance(b.model, TensorParallelModel)
        got = {label: answers(engine) for label, engine in zip(labels, (a, b), strict=True)}
        pair = agreement(*got.values())
        if args.pair == "tp" and pair < 1.0:
            raise SystemExit("tpbench: TP=1 and TP=2 greedy tokens differ; refusing to compare their step times")
        alike = {label: {"greedy_agreement_pair": pair, "greedy_agreement_float32": agreement(tokens, float32)}
                 for label, tokens in got.items()}
        points = [("decode", s) for s in slots] + [("prefill", args.prefill)]
        rows = measured_rows(list(zip(labels, (a, b), strict=True)), points, steps, rounds, args.prompt_len, alike)
        model_config = a.model.config
        print(f"{labels[0]}: {a.plan.reason}\n{labels[1]}: {b.plan.reason}")
    rows += gpu_rows(model_config, [1, 16, 256, 2048])
    write_csv(args.out, rows)
    print_tables(rows)
    print(f"wrote {args.out}")


def print_tables(rows: list[dict]) -> None:
    measured = [r for r in rows if r["bench"] == "measured"]
    labels = list(dict.fromkeys(r["engine"] for r in measured))
    by_point = {(r["workload"], r["slots_or_prompt_tokens"], r["engine"]): r for r in measured}
    agree = {r["engine"]: r["greedy_agreement_float32"] for r in measured}
    print(f"measured on this machine: A = {labels[0]}, B = {labels[1]}; median step ms (B's collectives: host ms "
          f"per step)\ngreedy tokens alike: A and B {measured[0]['greedy_agreement_pair']:.0%}; with float32's (the "
          f"exact path): A {agree[labels[0]]:.0%}, B {agree[labels[1]]:.0%}")
    print(f"{'workload':<10}{'size':>6}{'A ms':>10}{'B ms':>10}{'B/A':>9}{'all-reduces':>13}"
          f"{'AR KB':>9}{'AR ms':>8}{'gather ms':>11}{'plan ms':>9}")
    for (workload, size, label), two in by_point.items():
        if label != labels[1]:
            continue
        one = by_point[(workload, size, labels[0])]
        print(f"{workload:<10}{size:>6}{one['step_ms_median']:>10.2f}{two['step_ms_median']:>10.2f}"
              f"{two['step_ms_median'] / one['step_ms_median']:>9.2f}{two['all_reduces_per_step']:>13.0f}"
              f"{two['all_reduce_bytes_per_step'] / 1024:>9.0f}{two['all_reduce_ms_per_step']:>8.2f}"
              f"{two['gather_ms_per_step']:>11.2f}{two['plan_ms_per_step']:>9.2f}")
    print("\ncomputed for an 8-GPU NVLink node (published NCCL figures, see GPU_FIGURES): all-reduce us per step")
    print(f"{'TP':>3}{'tokens/step':>13}{'AR bytes/step':>15}{'AR us/step':>16}{'weights read us':>17}")
    for r in rows:
        if r["bench"] == "gpu_model":
            span = f"{r['all_reduce_us_per_step_low']:.0f}-{r['all_reduce_us_per_step_high']:.0f}"
            print(f"{r['tp']:>3}{r['tokens_per_step']:>13}{r['all_reduce_bytes_per_step']:>15,}{span:>16}"
                  f"{r['weight_read_us_per_step']:>17.1f}")


if __name__ == "__main__":
    main()
