"""peerbench's precision axis: nanoserve and llama.cpp on the same GGUF file, decode against decode.

Each pair serves one file: the f32 GGUF of the default model's weights (written by the setup from
the dequantized Q4_1), BF16, Q8_0, Q4_K_M, Q5_K_M, Q6_K, IQ4_XS and Q3_K_M GGUFs made from it by
llama.cpp's own llama-quantize, and the shipped Q4_1 file itself; then random files in real shapes
(SHAPES below: Llama 3.2 1B and 3B; benchmarks/peerbench/realshapes.py: a mixture of experts in
Qwen3-30B-A3B's layers, Gemma 3 1B, Phi-4-mini). --bandwidth counts what a token reads from the
file at one sequence (realshapes.token_read_bytes: every tensor once, one row of an untied
embedding, k of X experts of a mixture's stacked expert tensors), for both systems alike. Prefill is compared too: prompt
tokens/s over the prompts of every slot (llama-batched-bench's S_PP). nanoserve serves each file as stored (f32 in float32; BF16 in bfloat16;
Q8_0 and Q4_1 as int4 kernel passes with bf16 activations where the probe picks bf16), llama.cpp
runs llama-batched-bench on it, and transformers' generate runs the same weights (the converted
float32 directory) in float32 and bfloat16. The figure compared is the aggregate decode rate at the same
number of sequences: llama-batched-bench's S_TG against nanoserve's tokens per second over decode
steps (prompts of --pp tokens, the prefill and the first decode left out, tg - 2 steps timed). Each side is a fresh process, one at a time,
the pairs interleaved round by round; the report is medians and their ratio.

    python -m benchmarks.peerbench --setup-llamacpp              # once: the f32 GGUF and the binaries
    python -m benchmarks.peerbench.precision --slots 1 16 32 --rounds 2
    python -m benchmarks.peerbench.precision --pairs q4_1 --slots 1 --kernels torch blockdot   # both kernels
    python -m benchmarks.peerbench.precision --pairs q4_k_m q5_k_m q6_k q8_0 iq4_xs --rounds 3 --no-transformers

--kernels runs nanoserve once per value on the quantized files (PlanOverrides.kernels: auto, torch,
blockdot), each against the same llama.cpp runs; --unfused adds a run of each with
PlanOverrides.fused_decode=False (decode steps through llama.py's decoder_layer, not fused_decode.c).
--kv-cache-dtype float16 gives nanoserve's dense files the K/V cache llama.cpp runs them with (its
default, f16); nanoserve's "auto" keeps a dense model's cache in its dtype (the exact path's float32)
and makes a quantized one's float16 (the precision column says /kv16).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.peerbench import realshapes
from benchmarks.peerbench.launcher import ROOT, run_child
from benchmarks.peerbench.llamacpp import (
    BATCHED_BENCH,
    GGUF_NAME,
    IK_BATCHED_BENCH,
    PEERS_DIR,
    convert_checkpoint,
    parse_batched_bench,
)
from nanoserve.instruments.csv_writer import write_csv

QUANTIZE = BATCHED_BENCH.parent / "llama-quantize"
# name -> (GGUF file under .peers or "shipped", nanoserve dtype, nanoserve quantization)
PAIRS = {
    "f32": (GGUF_NAME, "float32", None),
    "bf16": ("smollm2-135m-bf16.gguf", "bfloat16", None),
    "q8_0": ("smollm2-135m-q8_0.gguf", "auto", "auto"),
    "q4_1": ("shipped", "auto", "auto"),
    # the file types most GGUF downloads are, made by llama-quantize from the f32 file: the default
    # model's 576-wide matrices fall back to Q5_0/Q5_1/Q8_0/IQ4_NL, its 1536-wide down projections
    # are the K-quant (notes/gguf-types.md)
    "q4_k_m": ("smollm2-135m-q4_k_m.gguf", "auto", "auto"),
    "q5_k_m": ("smollm2-135m-q5_k_m.gguf", "auto", "auto"),
    "q6_k": ("smollm2-135m-q6_k.gguf", "auto", "auto"),
    "iq4_xs": ("smollm2-135m-iq4_xs.gguf", "auto", "auto"),
    "q3_k_m": ("smollm2-135m-q3_k_m.gguf", "auto", "auto"),
    "1b_q4_k_m": ("1b:Q4_K_M", "auto", "auto"),  # SHAPES below
    "3b_q4_k_m": ("3b:Q4_K_M", "auto", "auto"),
    "1b_iq4_xs": ("1b:IQ4_XS", "auto", "auto"),
    # real layer shapes in bf16 on disk (benchmarks/peerbench/realshapes.py): Qwen3-30B-A3B's layers
    # (8 of 48), Gemma 3 1B's and Phi-4-mini's whole stacks
    "moe_q4_k_m": ("qwen3-moe:Q4_K_M", "auto", "auto"),
    "gemma3_q4_k_m": ("gemma3-1b:Q4_K_M", "auto", "auto"),
    "phi4mini_q4_k_m": ("phi4-mini:Q4_K_M", "auto", "auto"),
}
DEFAULT_PAIRS = ("f32", "bf16", "q8_0", "q4_1")

CHILD = r"""
import json, sys
import psutil, torch
from nanoserve import Engine, EngineConfig, PlanOverrides
from nanoserve.instruments.runners import decode_rate

gguf, dtype, quantization, kernels, fused, kv, pp, tg, threads = *sys.argv[1:7], *map(int, sys.argv[7:10])
slots_list = [int(s) for s in sys.argv[10:]]
torch.set_num_threads(threads)
config = EngineConfig(dtype=dtype, quantization=None if quantization == "none" else quantization,
                      max_num_seqs=max(slots_list), max_model_len=pp + tg + 8, kv_cache_dtype=kv,
                      overrides=PlanOverrides(kernels=kernels.removesuffix("-int16").removesuffix("-noamx"),
                                              fused_decode=fused == "fused", blockdot_int8=not kernels.endswith("-int16"),
                                              blockdot_amx_rows=False if kernels.endswith("-noamx") else "auto"))
engine = Engine.from_pretrained(gguf, config)
rates = {slots: decode_rate(engine, slots, tg - 2, pp) for slots in slots_list}


def prefill_rate(slots):
    # prompt tokens/s from adding `slots` prompts of pp tokens until every one is computed, as
    # llama-batched-bench's S_PP times its prompt batch
    import time
    from nanoserve import SamplingParams
    vocab = engine.model.config.vocab_size
    start = time.perf_counter()
    for i in range(slots):
        engine.add_request([(200 + (i * 11 + j) % 1000) % vocab for j in range(pp)],
                           SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        engine.step()
    seconds = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return slots * pp / seconds


prefill = {slots: prefill_rate(slots) for slots in slots_list}
# VmHWM: this process's own peak (execve starts a new one; ru_maxrss would keep the parent's)
peak = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")) / 1024
print(json.dumps({"rates": rates, "prefill": prefill, "rss_mib": psutil.Process().memory_info().rss / 2**20, "peak_rss_mib": peak,
                  "dtype": engine.plan.dtype, "quantization": engine.plan.quantization,
                  "kernels": engine.plan.kernels + (f"+amx{engine.plan.amx_rows}" if engine.plan.amx_rows else ""), "fused": engine.model.fused_layers is not None,
                  "kv_cache_dtype": engine.plan.kv_cache_dtype, "memory": engine.memory()}))
"""

# transformers' generate on the same weights (the converted float32 directory), in float32 and bf16:
# a logits processor stamps each decode step, so the rate is median-step based like the others.
HF_CHILD = r"""
import json, statistics, sys, time
import psutil, torch
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList
from nanoserve.model.default import default_model_dir

dtype, pp, tg, threads = sys.argv[1], *map(int, sys.argv[2:5])
slots_list = [int(s) for s in sys.argv[5:]]
torch.set_num_threads(threads)
model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=getattr(torch, dtype)).eval()
vocab = model.config.vocab_size

class Stamps(LogitsProcessor):
    def __init__(self):
        self.times = []
    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores

rates = {}
for slots in slots_list:
    ids = torch.tensor([[(100 + (i * 7 + j) % 1000) % vocab for j in range(pp)] for i in range(slots)])
    stamps = Stamps()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tg, min_new_tokens=tg,
                       do_sample=False, logits_processor=LogitsProcessorList([stamps]),
                       pad_token_id=model.config.eos_token_id)
    gaps = [b - a for a, b in zip(stamps.times[1:], stamps.times[2:])]  # decode steps, the first left out
    rates[slots] = slots / statistics.median(gaps)
print(json.dumps({"rates": rates, "prefill": prefill, "rss_mib": psutil.Process().memory_info().rss / 2**20}))
"""
HF_DTYPES = {"f32": "float32", "bf16": "bfloat16"}  # transformers' rows, matched with these pairs

# The machine's read bandwidth, in the same run: the best of 5 sums over 1 GiB of float32 (torch's
# threads as given), the rate a decode step that reads every weight once could reach at best.
BANDWIDTH_CHILD = r"""
import sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
t = torch.ones(2**28)
best = min((lambda s: (t.sum(), time.perf_counter() - s)[1])(time.perf_counter()) for _ in range(5))
print(t.nbytes / best / 1e9)
"""


def read_bandwidth_gbs(threads: int) -> float:
    proc = subprocess.run([sys.executable, "-c", BANDWIDTH_CHILD, str(threads)], capture_output=True, text=True,
                          check=True, timeout=600)
    return float(proc.stdout.strip().splitlines()[-1])


# 1B- and 3B-class files: random weights in Llama-3.2-1B's and -3B's shapes (the default tokenizer's
# vocabulary), written by llama.cpp's converter and llama-quantize, where per-layer overheads matter
# less than bandwidth.
ONE_B = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
         "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-5}
THREE_B = ONE_B | {"hidden_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 24, "head_dim": 128}
SHAPES = {"1b": ONE_B, "3b": THREE_B}


def shaped_file(size: str, file_type: str) -> Path:
    """The `size`-class file (a key of SHAPES) in `file_type` (llama-quantize's name), made once under
    .peers/: the random checkpoint (seeded), its f32 GGUF by convert_hf_to_gguf.py (kept: 5 GB for the
    1B class, 13 GB for the 3B), then llama-quantize."""
    out = PEERS_DIR / f"llama32-{size}-shape-random-{file_type.lower()}.gguf"
    if out.is_file():
        return out
    f32 = PEERS_DIR / f"llama32-{size}-shape-random-f32.gguf"
    if not f32.is_file():
        import shutil

        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        from nanoserve.model.default import default_model_dir

        folder = PEERS_DIR / f"llama32-{size}-shape-random"
        torch.manual_seed(0)
        source = default_model_dir()
        model = LlamaForCausalLM(LlamaConfig(vocab_size=49152, bos_token_id=1, eos_token_id=2, **SHAPES[size]))
        model.save_pretrained(folder)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, folder / name)
        del model
        convert_checkpoint(folder, f32, "f32")
        shutil.rmtree(folder)
    subprocess.run([str(QUANTIZE), str(f32), str(out), file_type], check=True, capture_output=True)
    return out


def gguf_files(names=tuple(PAIRS)) -> dict[str, Path]:
    """Each named pair's file, making the quantized GGUFs from the f32 one with llama-quantize once.

    Raises:
        FileNotFoundError: naming the setup command when the f32 GGUF or llama-quantize is missing.
    """
    from nanoserve.model.default import gguf_path

    f32 = PEERS_DIR / GGUF_NAME
    if not f32.is_file() or not QUANTIZE.is_file():
        raise FileNotFoundError(f"{f32} or {QUANTIZE} missing: run `python -m benchmarks.peerbench --setup-llamacpp`")
    files = {}
    for name in names:
        file = PAIRS[name][0]
        size, _, file_type = file.partition(":")
        if size in SHAPES:
            files[name] = shaped_file(size, file_type)
            continue
        if size in realshapes.REAL_SHAPES:
            files[name] = realshapes.shaped_file(size, file_type)
            continue
        path = gguf_path() if file == "shipped" else PEERS_DIR / file
        if not path.is_file():
            subprocess.run([str(QUANTIZE), str(f32), str(path), name.upper()], check=True, capture_output=True)
        files[name] = path
    return files


def nanoserve_rates(gguf: Path, dtype: str, quantization: str | None, pp: int, tg: int, threads: int,
                    slots: list[int], kernels: str = "auto", fused: bool = True, kv_cache_dtype: str = "auto") -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(gguf), dtype, quantization or "none", kernels,
                           "fused" if fused else "unfused", kv_cache_dtype, str(pp), str(tg), str(threads),
                           *map(str, slots)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"nanoserve child on {gguf.name} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    quantized = f"/{result['kernels']}" if result["quantization"] else ""
    quantized += "/fused" if result["fused"] else ""  # the glue in C (nanoserve.model.fused_decode)
    quantized += "/kv16" if result["kv_cache_dtype"] == "float16" else ""  # a float16 K/V cache, as llama.cpp's
    return {"rates": {int(k): v for k, v in result["rates"].items()},
            "prefill": {int(k): v for k, v in result["prefill"].items()}, "rss_mib": result["rss_mib"],
            "weight_bytes": sum(v for k, v in result["memory"].items() if k in ("dense", "quantized")),
            "peak_rss_mib": result["peak_rss_mib"], "kv_pool_mib": result["memory"]["kv_cache"] / 2**20,
            "precision": f"{result['dtype']}/{result['quantization']}{quantized}"}


def hf_rates(dtype: str, pp: int, tg: int, threads: int, slots: list[int]) -> dict:
    proc = subprocess.run([sys.executable, "-c", HF_CHILD, dtype, str(pp), str(tg), str(threads), *map(str, slots)],
                          capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"transformers child in {dtype} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"rates": {int(k): v for k, v in result["rates"].items()}, "rss_mib": result["rss_mib"]}


def parse_batched_bench_table(text: str) -> list[dict[str, float]]:
    """The rows of llama-batched-bench's markdown table (ik_llama.cpp's prints no JSONL):
    | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and all(c.replace(".", "", 1).isdigit() for c in cells):
            values = [float(c) for c in cells]
            rows.append({"pl": values[2], "speed_pp": values[5], "speed_tg": values[7]})
    return rows


def llama_rates(gguf: Path, pp: int, tg: int, threads: int, slots: list[int], ik: bool = False) -> dict:
    """llama-batched-bench's S_TG (aggregate decode tokens/s) at each number of sequences, llama.cpp's
    or (ik) ik_llama.cpp's; f16 KV and the rest of its defaults."""
    cmd = [str(IK_BATCHED_BENCH if ik else BATCHED_BENCH), "-m", str(gguf), "-c", str(max(slots) * (pp + tg)),
           "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, slots)),
           "-t", str(threads), "-tb", str(threads), *([] if ik else ["--output-format", "jsonl"])]
    if ik:  # its table goes to stderr: the shell hands it to stdout and becomes the binary (exec)
        cmd = ["sh", "-c", 'exec "$0" "$@" 2>&1', *cmd]
    # in its build folder: ik_llama.cpp writes llama.log where it runs
    child = run_child(cmd, 1800, None, cwd=IK_BATCHED_BENCH.parent if ik else None)
    parse = parse_batched_bench_table if ik else parse_batched_bench
    rows = {int(r["pl"]): r for r in parse(child.result or "")}
    missing = [s for s in slots if s not in rows]
    if missing:
        raise RuntimeError(f"llama-batched-bench on {gguf.name} gave no row for {missing}: {child.error}")
    return {"rates": {s: float(rows[s]["speed_tg"]) for s in slots},
            "prefill": {s: float(rows[s]["speed_pp"]) for s in slots}, "rss_mib": child.peak_rss_mib}


def paired(ours: list[dict], theirs: list[dict], slots: int) -> tuple[float, float, list[float], float]:
    """Two systems' interleaved rounds at `slots`: their median decode rates, each round's own ratio
    (the spread) and the ratio of their median prefill rates."""
    n, t = (statistics.median(x["rates"][slots] for x in runs) for runs in (ours, theirs))
    per_round = [a["rates"][slots] / b["rates"][slots] for a, b in zip(ours, theirs, strict=False)]
    pp_ratio = (statistics.median(x["prefill"][slots] for x in ours)
                / statistics.median(x["prefill"][slots] for x in theirs))
    return n, t, per_round, pp_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", nargs="+", default=list(DEFAULT_PAIRS), choices=list(PAIRS))
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16, 32])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pp", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--tg", type=int, default=64, help="generated tokens per sequence")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-transformers", action="store_true",
                        help="leave out transformers generate in float32 and bfloat16 (same weights)")
    parser.add_argument("--kernels", nargs="+", default=["auto"], choices=["auto", "torch", "blockdot", "blockdot-int16", "blockdot-noamx"],
                        help="nanoserve's kernels on the quantized files, one run each (blockdot-int16: K-quants "
                             "on blockdot's wider panels, PlanOverrides.blockdot_int8=False; blockdot-noamx: "
                             "file-bit panels never on AMX tiles, PlanOverrides.blockdot_amx_rows=False)")
    parser.add_argument("--unfused", action="store_true",
                        help="also run each of those with fused_decode=False")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="nanoserve's EngineConfig.kv_cache_dtype (llama.cpp's cache is float16, its default)")
    parser.add_argument("--bandwidth", action="store_true",
                        help="measure the read bandwidth each round; report each system's decode rate at one "
                             "sequence times the bytes it reads a token, as a share of it")
    parser.add_argument("--ik", action="store_true",
                        help="also run ik_llama.cpp's llama-batched-bench on each file, interleaved "
                             "(python -m benchmarks.peerbench --setup-ik-llamacpp builds it)")
    parser.add_argument("--out", default="runs/peerbench_precision.csv")
    args = parser.parse_args()
    if args.ik and not IK_BATCHED_BENCH.is_file():
        parser.error(f"--ik: no {IK_BATCHED_BENCH} (python -m benchmarks.peerbench --setup-ik-llamacpp)")
    if args.rounds < 1 or min(args.slots) < 1:
        parser.error("--rounds and every --slots value must be >= 1")
    files = gguf_files(args.pairs)
    got: dict[tuple[str, str], list[dict]] = {}
    bandwidths: list[float] = []
    for r in range(args.rounds):
        if args.bandwidth:
            bandwidths.append(read_bandwidth_gbs(args.threads))
            print(f"  round {r + 1} read bandwidth: {bandwidths[-1]:.1f} GB/s", flush=True)
        for name in args.pairs:
            _, dtype, quantization = PAIRS[name]
            ours = [f"nanoserve:{k}" for k in (args.kernels if quantization else args.kernels[:1])]
            ours += [f"{system}:unfused" for system in ours] if args.unfused else []
            peers = ["llama.cpp", "ik_llama.cpp"] if args.ik else ["llama.cpp"]
            order = [*ours, *peers] if r % 2 == 0 else [*peers, *ours]
            for system in order:
                if system.startswith("nanoserve"):
                    result = nanoserve_rates(files[name], dtype, quantization, args.pp, args.tg, args.threads,
                                             args.slots, system.split(":")[1], not system.endswith(":unfused"),
                                             args.kv_cache_dtype)
                else:
                    result = llama_rates(files[name], args.pp, args.tg, args.threads, args.slots,
                                         ik=system == "ik_llama.cpp")
                got.setdefault((name, system), []).append(result)
                print(f"  round {r + 1} {name} {system}: "
                      + ", ".join(f"{s}: {v:.1f}" for s, v in result["rates"].items()), flush=True)
        for name, dtype in HF_DTYPES.items() if not args.no_transformers else ():
            result = hf_rates(dtype, args.pp, args.tg, args.threads, args.slots)
            got.setdefault((name, "transformers"), []).append(result)
            print(f"  round {r + 1} transformers {dtype}: "
                  + ", ".join(f"{s}: {v:.1f}" for s, v in result["rates"].items()), flush=True)
    rows = []
    print(f"\npeerbench precision: decode tok/s (aggregate, median of {args.rounds}), pp={args.pp} tg={args.tg}, "
          f"{args.threads} threads")
    print(f"{'file':<7}{'nanoserve as':<32}{'slots':>6}{'nanoserve':>11}{'llama.cpp':>11}{'ratio':>8}{'spread':>12}"
          f"{'prefill ratio':>14}{'RSS MiB n end/peak, l peak, n pool':>36}")
    for name, system in [key for key in got if key[1].startswith("nanoserve")]:
        ours, theirs = got[(name, system)], got[(name, "llama.cpp")]
        for s in args.slots:
            n, ll, per_round, pp_ratio = paired(ours, theirs, s)
            rss_n = max(x["rss_mib"] for x in ours)
            peak_n, pool_n = max(x["peak_rss_mib"] for x in ours), max(x["kv_pool_mib"] for x in ours)
            rss_l = max((x["rss_mib"] for x in theirs if not math.isnan(x["rss_mib"])), default=math.nan)
            spread = f"{min(per_round):.2f}-{max(per_round):.2f}"
            print(f"{name:<7}{ours[0]['precision']:<32}{s:>6}{n:>11.1f}{ll:>11.1f}{n / ll:>8.2f}{spread:>12}"
                  f"{pp_ratio:>14.2f}{rss_n:>14.0f}/{peak_n:<6.0f}{rss_l:>6.0f}{pool_n:>8.0f}")
            rows.append({"file": name, "gguf": files[name].name, "nanoserve_precision": ours[0]["precision"],
                         "slots": s, "nanoserve_decode_tok_s": n, "llamacpp_decode_tok_s": ll,
                         "nanoserve_over_llamacpp": n / ll, "ratio_min": min(per_round), "ratio_max": max(per_round),
                         "nanoserve_prefill_tok_s": statistics.median(x["prefill"][s] for x in ours),
                         "llamacpp_prefill_tok_s": statistics.median(x["prefill"][s] for x in theirs),
                         "prefill_nanoserve_over_llamacpp": pp_ratio, "nanoserve_rss_mib": rss_n, "nanoserve_peak_rss_mib": peak_n,
                         "nanoserve_kv_pool_mib": pool_n, "llamacpp_peak_rss_mib": rss_l,
                         "pp": args.pp, "tg": args.tg, "rounds": args.rounds, "threads": args.threads,
                         "date": time.strftime("%Y-%m-%d")})
    if args.ik:
        print(f"\nnanoserve over ik_llama.cpp's llama-batched-bench (median of {args.rounds}, per-round spread):")
        for name, system in [key for key in got if key[1].startswith("nanoserve")]:
            ours, theirs = got[(name, system)], got[(name, "ik_llama.cpp")]
            for s in args.slots:
                n, ik, per_round, pp_ratio = paired(ours, theirs, s)
                print(f"  {name:<10} {s:>3} slots: nanoserve {n:.1f}, ik_llama.cpp {ik:.1f} tok/s, ratio {n / ik:.2f} "
                      f"({min(per_round):.2f}-{max(per_round):.2f}), prefill ratio {pp_ratio:.2f}")
                rows.append({"file": name, "gguf": files[name].name, "nanoserve_precision": ours[0]["precision"],
                             "slots": s, "nanoserve_decode_tok_s": n, "ik_llamacpp_decode_tok_s": ik,
                             "nanoserve_over_ik_llamacpp": n / ik, "ratio_min": min(per_round),
                             "ratio_max": max(per_round), "prefill_nanoserve_over_ik_llamacpp": pp_ratio,
                             "pp": args.pp, "tg": args.tg, "rounds": args.rounds, "threads": args.threads,
                             "date": time.strftime("%Y-%m-%d")})
    if not args.no_transformers:
        default = got[("q4_1", f"nanoserve:{args.kernels[0]}")] if "q4_1" in args.pairs else None
        print("\ntransformers generate on the same weights (static batch), nanoserve over it:")
        print(f"{'transformers':<14}{'slots':>6}{'tok/s':>9}{'matched nanoserve':>19}{'ratio':>7}"
              f"{'default nanoserve':>19}{'ratio':>7}")
        for name, dtype in HF_DTYPES.items():
            theirs = got[(name, "transformers")]
            ours = got.get((name, f"nanoserve:{args.kernels[0]}"))
            for s in args.slots:
                hf = statistics.median(x["rates"][s] for x in theirs)
                matched = statistics.median(x["rates"][s] for x in ours) if ours else math.nan
                best = statistics.median(x["rates"][s] for x in default) if default else math.nan
                print(f"{dtype:<14}{s:>6}{hf:>9.1f}{matched:>19.1f}{matched / hf:>7.2f}{best:>19.1f}{best / hf:>7.2f}")
                rows.append({"file": name, "gguf": "converted float32 directory", "nanoserve_precision": "",
                             "slots": s, "transformers_dtype": dtype, "transformers_decode_tok_s": hf,
                             "nanoserve_matched_decode_tok_s": matched, "nanoserve_over_transformers": matched / hf,
                             "nanoserve_default_decode_tok_s": best, "default_over_transformers": best / hf,
                             "transformers_rss_mib": max(x["rss_mib"] for x in theirs),
                             "pp": args.pp, "tg": args.tg, "rounds": args.rounds, "threads": args.threads,
                             "date": time.strftime("%Y-%m-%d")})
    if bandwidths and 1 in args.slots:
        bandwidth = statistics.median(bandwidths)
        print(f"\nat one sequence, the bytes a token reads from the file x tokens/s over the read bandwidth "
              f"({bandwidth:.1f} GB/s, median of {len(bandwidths)}: {min(bandwidths):.1f}-{max(bandwidths):.1f}):")
        for name, system in [key for key in got if key[1].startswith("nanoserve")]:
            ours, theirs = got[(name, system)], got[(name, "llama.cpp")]
            read = realshapes.token_read_bytes(files[name])
            n = statistics.median(x["rates"][1] for x in ours) * read["total"] / 1e9 / bandwidth
            ll = statistics.median(x["rates"][1] for x in theirs) * read["total"] / 1e9 / bandwidth
            print(f"  {name:<10} nanoserve {n:.0%}, llama.cpp {ll:.0%} (a token reads {read['total'] / 2**20:.0f} MiB "
                  f"of the file's {read['file'] / 2**20:.0f} MiB; nanoserve holds "
                  f"{ours[0]['weight_bytes'] / 2**20:.0f} MiB of weights)")
            rows.append({"file": name, "gguf": files[name].name, "slots": 1, "read_bandwidth_gbs": bandwidth,
                         "token_read_bytes": read["total"], "file_bytes": read["file"],
                         "nanoserve_weight_bytes": ours[0]["weight_bytes"], "nanoserve_share_of_bandwidth": n,
                         "llamacpp_share_of_bandwidth": ll,
                         "rounds": args.rounds, "threads": args.threads, "date": time.strftime("%Y-%m-%d")})
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
