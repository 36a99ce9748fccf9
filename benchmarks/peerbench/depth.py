"""peerbench's depth axis: decode at a deep context, nanoserve against llama-batched-bench on one file.

At thousands of tokens of context a decode step reads the K/V cache as well as the weights, so the
cache's element type decides the rate as much as the weights' kernels do. For each K/V cache type
(float16, and q8_0 / q4_0, llama.cpp's `-ctk/-ctv` block formats), each depth (prompt tokens a
sequence) and each number of sequences, both systems prefill the prompts and decode `--tg` tokens;
the figure compared is the aggregate decode rate: llama-batched-bench's S_TG against nanoserve's
sequences over its median decode step (the first decode left out). Each side is a fresh process,
one at a time, the two interleaved round by round (A B, B A, ...); the report is medians, the
per-round ratios' spread, and at one sequence each side's share of the machine's read bandwidth
(a 2-thread sum over 1 GiB, measured each round) counted in the bytes a token reads: the file's
tensors as precision.py's --bandwidth counts them (realshapes.token_read_bytes: every tensor once,
one row of an untied embedding, k of X experts), the same for both systems, plus the K/V of the
context in each system's own cache bytes.

Prompts are different for every sequence (nanoserve: token ids as `decode_step_times` makes them;
llama-batched-bench: its own), unless --shared-prompt: then every sequence has one prompt
(llama-batched-bench -pps; nanoserve's prefix cache shares its blocks), which is what makes 4
sequences at 16k affordable to prefill on two cores, and is said in the table.

    python -m benchmarks.peerbench.depth --pairs 1b_q4_k_m --depths 4096 --slots 1 4 --kv float16 q8_0
    python -m benchmarks.peerbench.depth --pairs 1b_q4_k_m --depths 16384 --slots 1 --kv float16 q8_0 --rounds 3

llama.cpp runs a quantized cache with flash attention on (`-fa on`: a quantized V cache needs it) and
a float16 cache with it off, its faster decode at depth on CPUs (`-fa auto` turns it on:
notes/depth.md has both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peerbench import realshapes
from benchmarks.peerbench.launcher import ROOT, run_child
from benchmarks.peerbench.llamacpp import BATCHED_BENCH, parse_batched_bench
from benchmarks.peerbench.precision import PAIRS, gguf_files, read_bandwidth_gbs
from nanoserve.instruments.csv_writer import write_csv

KV_TYPES = {"float16": "f16", "q8_0": "q8_0", "q4_0": "q4_0"}  # nanoserve's name -> llama.cpp's -ctk/-ctv

CHILD = r"""
import json, statistics, sys, time
import psutil, torch
from nanoserve import Engine, EngineConfig, SamplingParams

gguf, kv, shared = sys.argv[1], sys.argv[2], sys.argv[3] == "shared"
depth, tg, threads = map(int, sys.argv[4:7])
slots_list = [int(s) for s in sys.argv[7:]]
torch.set_num_threads(threads)
seq_len = depth + tg + 8
config = EngineConfig(max_num_seqs=max(slots_list), max_model_len=seq_len, kv_cache_dtype=kv,
                      max_num_batched_tokens=512, block_size=16,
                      num_kv_blocks=max(slots_list) * (seq_len // 16 + 2))
engine = Engine.from_pretrained(gguf, config)
vocab = engine.model.config.vocab_size


def prompt_in():
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()


rates, prefill = {}, {}
for slots in slots_list:
    # every request runs tg + 8 tokens: the tg - 2 timed steps end before the first of them retires
    params = SamplingParams(temperature=0.0, max_tokens=tg + 8, ignore_eos=True)
    # a new prompt for each count of slots (none found in the prefix cache from the last)
    prompts = [[(100 + ((0 if shared else i) * 7 + slots * 13 + j) % 1000) % vocab for j in range(depth)] for i in range(slots)]
    start = time.perf_counter()
    engine.add_request(prompts[0], params)
    if shared:  # the others find its blocks in the prefix cache, as llama-batched-bench -pps copies its cells
        prompt_in()
    for prompt in prompts[1:]:
        engine.add_request(prompt, params)
    prompt_in()
    prefill[slots] = (1 if shared else slots) * depth / (time.perf_counter() - start)
    engine.step()  # the first decode: uncounted
    times = []
    for _ in range(tg - 2):
        begin = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - begin)
    while engine.has_unfinished():
        engine.step()
    rates[slots] = slots / statistics.median(times)
memory = engine.memory()
kv_token = engine.kv.nbytes // (engine.kv.num_blocks * engine.kv.block_size)  # K and V, every layer
print(json.dumps({"rates": rates, "prefill": prefill, "kv_cache_dtype": engine.plan.kv_cache_dtype,
                  "weight_bytes": sum(v for k, v in memory.items() if k in ("dense", "quantized")),
                  "kv_bytes_per_token": kv_token, "rss_mib": psutil.Process().memory_info().rss / 2**20}))
"""


def nanoserve_depth(gguf: Path, kv: str, shared: bool, depth: int, tg: int, threads: int, slots: list[int]) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(gguf), kv, "shared" if shared else "own",
                           str(depth), str(tg), str(threads), *map(str, slots)],
                          capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"nanoserve child on {gguf.name} ({kv}, depth {depth}) failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("rates", "prefill"):
        result[key] = {int(k): v for k, v in result[key].items()}
    return result


def llama_depth(gguf: Path, kv: str, shared: bool, depth: int, tg: int, threads: int, slots: list[int]) -> dict:
    """llama-batched-bench's S_TG and S_PP at each number of sequences, its cache in `kv`'s type."""
    cache = KV_TYPES[kv]
    context = max(slots) * (depth + tg + 64)  # each sequence its own share of the cells (n_ctx / n_seq_max)
    cmd = [str(BATCHED_BENCH), "-m", str(gguf), "-c", str(context), "-b", "2048", "-ub", "512",
           "-npp", str(depth), "-ntg", str(tg), "-npl", ",".join(map(str, slots)), "-t", str(threads),
           "-tb", str(threads), "-ctk", cache, "-ctv", cache, "-fa", "off" if cache == "f16" else "on",
           *(["-pps"] if shared else []),
           "--output-format", "jsonl"]
    child = run_child(cmd, 3600, None)
    rows = {int(r["pl"]): r for r in parse_batched_bench(child.result or "")}
    missing = [s for s in slots if s not in rows]
    if missing:
        raise RuntimeError(f"llama-batched-bench on {gguf.name} gave no row for {missing}: {child.error}")
    return {"rates": {s: float(rows[s]["speed_tg"]) for s in slots},
            "prefill": {s: float(rows[s]["speed_pp"]) for s in slots}, "rss_mib": child.peak_rss_mib}


def kv_bytes_llama(gguf: Path, kv: str) -> int:
    """Bytes of K and V a token holds in llama.cpp's cache of `kv`'s type, from the file's header."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(gguf)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()

    def field(name: str) -> int:
        return int(reader.fields[f"{arch}.{name}"].parts[-1][0])

    layers, heads = field("block_count"), field("attention.head_count")
    kv_heads = field("attention.head_count_kv")
    key = f"{arch}.attention.key_length"
    head_dim = int(reader.fields[key].parts[-1][0]) if key in reader.fields else field("embedding_length") // heads
    per_row = {"f16": head_dim * 2, "q8_0": head_dim // 32 * 34, "q4_0": head_dim // 32 * 18}[KV_TYPES[kv]]
    return 2 * layers * kv_heads * per_row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=["1b_q4_k_m"], choices=list(PAIRS))
    parser.add_argument("--depths", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kv", nargs="+", default=["float16", "q8_0"], choices=list(KV_TYPES))
    parser.add_argument("--tg", type=int, default=32, help="generated tokens per sequence")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shared-prompt", action="store_true",
                        help="one prompt for every sequence (llama-batched-bench -pps; nanoserve's prefix cache)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="runs/peerbench_depth.csv")
    args = parser.parse_args()
    if args.rounds < 1 or min(args.slots) < 1 or min(args.depths) < 1 or args.tg < 4:
        parser.error("--rounds, --slots and --depths must be >= 1 and --tg >= 4")
    files = gguf_files(args.pairs)
    got: dict[tuple[str, str, int, str], list[dict]] = {}
    bandwidths = []
    for r in range(args.rounds):
        bandwidths.append(read_bandwidth_gbs(args.threads))
        print(f"  round {r + 1} read bandwidth: {bandwidths[-1]:.1f} GB/s", flush=True)
        for name in args.pairs:
            for depth in args.depths:
                for kv in args.kv:
                    order = ["nanoserve", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "nanoserve"]
                    for system in order:
                        run = nanoserve_depth if system == "nanoserve" else llama_depth
                        result = run(files[name], kv, args.shared_prompt, depth, args.tg, args.threads, args.slots)
                        got.setdefault((name, kv, depth, system), []).append(result)
                        print(f"  round {r + 1} {name} depth {depth} {kv} {system}: "
                              + ", ".join(f"{s}: {v:.2f}" for s, v in result["rates"].items())
                              + " (prefill " + ", ".join(f"{v:.0f}" for v in result["prefill"].values()) + " tok/s)",
                              flush=True)
    bandwidth = statistics.median(bandwidths)
    prompts = "one shared prompt" if args.shared_prompt else "a prompt each"
    print(f"\npeerbench depth: decode tok/s (aggregate, median of {args.rounds}), tg={args.tg}, {prompts}, "
          f"{args.threads} threads, read bandwidth {bandwidth:.1f} GB/s (median)")
    print(f"{'file':<11}{'kv':<9}{'depth':>7}{'slots':>6}{'nanoserve':>11}{'llama.cpp':>11}{'ratio':>7}{'spread':>12}"
          f"{'n bw%':>7}{'l bw%':>7}{'prefill ratio':>14}")
    rows = []
    for name in args.pairs:
        token_bytes = realshapes.token_read_bytes(files[name])["total"]
        for depth in args.depths:
            for kv in args.kv:
                ours, theirs = got[(name, kv, depth, "nanoserve")], got[(name, kv, depth, "llama.cpp")]
                for s in args.slots:
                    n, ll = (statistics.median(x["rates"][s] for x in runs) for runs in (ours, theirs))
                    per_round = [a["rates"][s] / b["rates"][s] for a, b in zip(ours, theirs, strict=True)]
                    pp_ratio = (statistics.median(x["prefill"][s] for x in ours)
                                / statistics.median(x["prefill"][s] for x in theirs))
                    # bytes a token reads at one sequence: the file's tensors once and its context's K/V
                    n_bytes = token_bytes + depth * ours[0]["kv_bytes_per_token"]
                    l_bytes = token_bytes + depth * kv_bytes_llama(files[name], kv)
                    n_bw = 100 * n * n_bytes / (bandwidth * 1e9) if s == 1 else float("nan")
                    l_bw = 100 * ll * l_bytes / (bandwidth * 1e9) if s == 1 else float("nan")
                    spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
                    print(f"{name:<11}{kv:<9}{depth:>7}{s:>6}{n:>11.2f}{ll:>11.2f}{n / ll:>7.2f}{spread:>12}"
                          f"{n_bw:>7.0f}{l_bw:>7.0f}{pp_ratio:>14.2f}")
                    rows.append({"file": name, "gguf": files[name].name, "kv_cache": kv, "depth": depth, "slots": s,
                                 "shared_prompt": args.shared_prompt, "nanoserve_decode_tok_s": n,
                                 "llamacpp_decode_tok_s": ll, "nanoserve_over_llamacpp": n / ll,
                                 "ratio_min": min(per_round), "ratio_max": max(per_round),
                                 "nanoserve_bytes_per_token": n_bytes, "llamacpp_bytes_per_token": l_bytes,
                                 "nanoserve_bandwidth_pct": n_bw, "llamacpp_bandwidth_pct": l_bw,
                                 "read_bandwidth_gbs": bandwidth,
                                 "nanoserve_prefill_tok_s": statistics.median(x["prefill"][s] for x in ours),
                                 "llamacpp_prefill_tok_s": statistics.median(x["prefill"][s] for x in theirs),
                                 "prefill_nanoserve_over_llamacpp": pp_ratio, "tg": args.tg, "rounds": args.rounds,
                                 "threads": args.threads, "date": time.strftime("%Y-%m-%d")})
    write_csv(args.out, rows)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
