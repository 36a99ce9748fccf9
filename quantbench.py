"""quantbench: every precision this machine offers against float32 on the same weights, accuracy
beside speed and memory, on the embedded default model (SmolLM2-135M-Instruct, its Q4_1 GGUF).

The reference is float32 over the GGUF's weights dequantized exactly. For each precision:
- over the fixed text data/quantbench.txt, teacher-forced (nanoserve.instruments.accuracy):
  perplexity and its change against float32, top-1 agreement with float32's next token, and the
  mean KL(float32 || precision) of the next-token distributions;
- greedy agreement on a prompt set: mean common-prefix length with float32's own greedy tokens
  and the share of runs that match to the end;
  a quantized precision teacher-forced one token a step as decode steps (what its decode steps
  run: blockdot, in one fused C call where it has one), not on the dense copy that steps of more
  than max_kernel_rows rows read; a dense one in chunks of 512;
- decode rate at 1 and 16 slots (aggregate tokens/s over decode steps) and resident memory, each
  precision in a fresh child process, one at a time, so nothing else shares the cores.
transformers' own model in bfloat16 is scored on the same text as the bar the default precision's
agreement is held to; where llama-cpp-python is importable (--llamacpp-path: a folder holding it,
installed apart from the venv, e.g. under .peers/), llama.cpp's own logits are scored too: on the
same Q4_1 file, and on the f32, BF16 and Q8_0 GGUFs of the same weights where peerbench's precision
axis has made them. A precision whose perplexity is more than 2% worse than float32 says so.

--file-types scores llama.cpp's file types of the default model instead (Q4_K_M, Q6_K, ...: made by
llama-quantize from the f32 GGUF): nanoserve's perplexity over each file's weights against
llama-perplexity's on the same file and text, by the same protocol (chunks of 512 evaluated alone,
each chunk's second half scored), with its top-1 agreement and mean KL against the f32 file, after
`python -m benchmarks.peerbench --setup-llamacpp` and `cmake --build .peers/llama.cpp-build --target
llama-perplexity`.

    python quantbench.py                         # the full text, every precision; a few minutes
    python quantbench.py --tokens 1024 --quick   # a smaller run
    python quantbench.py --file-types q4_k_m q5_k_m q6_k q8_0 iq4_xs q3_k_m --out runs/quantbench_types.csv
    python quantbench.py --kv-cache-dtype q8_0 q4_0 --context 4096 [--file model.gguf] --out runs/quantbench_kv.csv

--kv-cache-dtype scores a quantized K/V cache (llama.cpp's q8_0 / q4_0 blocks) against the float16
cache on the same weights (the default model, or --file's GGUF) at a long context: the text cut into
windows of --context tokens, each evaluated alone and its second half scored (llama-perplexity's
protocol), fed in chunks of 512 as chunked prefill feeds a prompt; perplexity, top-1 agreement and mean
KL against the float16 cache, beside `llama-perplexity -c N -fa on -ctk KIND -ctv KIND` over as many
windows of the same file and text where the binary is built (a quantized V cache needs flash attention
in llama.cpp). Both turn q, k and v by a Walsh-Hadamard matrix before quantizing them (nanoserve.model.kv_quant;
llama.cpp unless LLAMA_ATTN_ROT_DISABLE=1 is in the environment). --tokens N scores the text's first N tokens.

--model scores nanoserve against llama.cpp's own distributions on any GGUF file (a real-shape file of
benchmarks/peerbench/realshapes.py, say): `llama-perplexity -c N --chunks K --kl-divergence-base` saves
its log-probabilities over K windows of N tokens of the text (LlamaLogProbs reads the file), nanoserve
(the file as served: the plan's choices) scores the same tokens in the same windows, and each file gets
both perplexities, the mean KL(llama.cpp || nanoserve) and the top-1 agreement, computed as
`llama-perplexity --kl-divergence` computes them, and each side's mean top-1 probability:

    python quantbench.py --model .peers/qwen3-moe-shape-random-q4_k_m.gguf --context 512 --chunks 4 --out runs/x.csv

llama-cpp-python apart from the venv (after `python -m benchmarks.peerbench --setup-llamacpp`):
    CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
    -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" python -m pip install --no-deps \
    --target .peers/pylib-llama .peers/llama_cpp_python-*.tar.gz diskcache
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.instruments.accuracy import compare, greedy_agreement, teacher_forced_logits, worse_than
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.runners import decode_rate

ROOT = Path(__file__).resolve().parent
TEXT = ROOT / "data" / "quantbench.txt"
# name -> the EngineConfig it runs (the rest at their defaults): "auto" dtype lets the probe pick the
# activations, "auto" kernels the faster of blockdot and torch's at one row.
PRECISIONS = {
    "float32": {"dtype": "float32", "quantization": None},
    "bfloat16": {"dtype": "bfloat16", "quantization": None},
    "int8": {"quantization": "int8"},
    "int4": {"quantization": "int4"},
    "gguf-q4_1": {},  # the default: the file's own Q4_1 (and Q8_0 head) kept where it pays
    # the same with blockdot's activations rounded to int16 at every row count (the default's), and
    # never (float32 activations)
    "gguf-q4_1-int16": {"blockdot_int16_rows": 1},
    "gguf-q4_1-float": {"blockdot_int16_rows": None},
    "gguf-q4_1-torch": {"kernels": "torch"},  # on torch's kernels (bf16 scales, Q8_0 as two int4 passes)
    # the default with its K/V cache in float32 (its own, "auto", is float16 where its blocks are on
    # blockdot in float32), and exact float32 with a float16 cache (llama.cpp's default)
    "gguf-q4_1-kv32": {"kv_cache_dtype": "float32"},
    "float32-kv16": {"dtype": "float32", "quantization": None, "kv_cache_dtype": "float16"},
}
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of thermodynamics are",
    "import numpy as np\n", "My favourite recipe for bread", "In 1905 Albert Einstein", "The quick brown fox",
    "SELECT name FROM", "Dear hiring manager,", "The mitochondria is", "To be or not to be",
]


def engine_for(name: str, **overrides) -> Engine:
    return Engine.from_pretrained(None, EngineConfig(**PRECISIONS[name], **overrides))


def child(name: str, slots_list: list[int], steps: int) -> None:
    """One precision alone in this process: decode rates and resident memory, as one JSON line."""
    import psutil

    engine = engine_for(name, max_num_seqs=max(slots_list), max_model_len=1024)
    rates = {slots: decode_rate(engine, slots, steps) for slots in slots_list}
    print(json.dumps({"rates": rates, "rss_bytes": psutil.Process().memory_info().rss, "memory": engine.memory(),
                      "dtype": engine.plan.dtype, "quantization": engine.plan.quantization,
                      "reason": engine.plan.reason}))


def run_child(name: str, slots_list: list[int], steps: int, threads: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", name, "--slots", *map(str, slots_list),
                           "--steps", str(steps), "--threads", str(threads)],
                          capture_output=True, text=True, cwd=ROOT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"quantbench child {name} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--tokens", type=int, default=None, help="score the text's first N tokens (default: all)")
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per slot count")
    parser.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--quick", action="store_true", help="4 prompts, 8 decode steps")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' bf16 bar")
    parser.add_argument("--llamacpp-path", default=str(ROOT / ".peers" / "pylib-llama"),
                        help="a folder holding llama-cpp-python (scored where it imports)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--out", default="runs/quantbench.csv")
    parser.add_argument("--file-types", nargs="+", default=None, metavar="PAIR",
                        help="instead: perplexity of llama.cpp file types of the default model (peerbench's "
                             "precision pairs, e.g. q4_k_m q6_k) by nanoserve and by llama-perplexity")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=None, choices=list(KV_CACHE_TYPES), metavar="KIND",
                        help="instead: K/V caches of these kinds (q8_0, q4_0) against the float16 cache at --context")
    parser.add_argument("--context", type=int, default=None,
                        help="--kv-cache-dtype's window in tokens (default 4096), --model's (default 512)")
    parser.add_argument("--model", nargs="+", type=Path, default=None, metavar="FILE",
                        help="instead: nanoserve against llama-perplexity's own log-probabilities on each GGUF file, "
                             "over the same --chunks windows of --context tokens")
    parser.add_argument("--chunks", type=int, default=4, help="--model's windows")
    parser.add_argument("--file", type=Path, default=None,
                        help="--kv-cache-dtype on this GGUF file (default: the default model's)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.file_types:
        file_types(args.file_types, args.threads, args.out)
        return
    if args.model:
        models(args.model, args.context or CHUNK, args.chunks, args.threads, args.out)
        return
    if args.kv_cache_dtype:
        kv_caches(args.kv_cache_dtype, args.context or 4096, args.file, args.threads, args.out, args.tokens)
        return
    if args.child:
        child(args.child, args.slots, args.steps)
        return
    prompts = PROMPTS[:4] if args.quick else PROMPTS
    steps = 8 if args.quick else args.steps
    if "float32" not in args.precisions:
        args.precisions.insert(0, "float32")

    reference_engine = engine_for("float32", max_model_len=8192)
    token_ids = reference_engine.tokenizer.encode(TEXT.read_text())[: args.tokens]
    targets = torch.tensor(token_ids[1:])
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"quantbench: SmolLM2-135M-Instruct (its Q4_1 GGUF), {len(token_ids)} tokens of {TEXT.name}, "
          f"{len(prompts)} prompts x {args.max_tokens} greedy tokens, {args.threads} threads")
    reference = teacher_forced_logits(reference_engine.model, token_ids)[:-1]
    reference_runs = [o.token_ids for o in reference_engine.generate(prompts, greedy)]
    del reference_engine

    rows = []
    for name in args.precisions:
        # One token a step and 8 slots: a quantized precision is scored on what serves its decode
        # steps, not on the dense copy that serves wider steps (scored apart as the dense dtype's own row);
        # so is a cache in another dtype than the model's, every position reading its rounded K/V.
        engine = engine_for(name, max_model_len=8192, max_num_seqs=8)
        kv_dtype = engine.kv.dtype
        chunk = 1 if engine.plan.quantization or kv_dtype != engine.model.dtype else 512
        logits = teacher_forced_logits(engine.model, token_ids, chunk=chunk, kv_dtype=kv_dtype)
        report = compare(reference, logits[:-1], targets)
        del logits
        agreement = greedy_agreement(reference_runs, [o.token_ids for o in engine.generate(prompts, greedy)])
        precision = engine.plan
        del engine
        measured = run_child(name, args.slots, steps, args.threads)
        rows.append(accuracy_row(name, precision.dtype, precision.quantization, report) | {
            "kernels": precision.kernels if precision.quantization else "", "kv_cache": str(kv_dtype).removeprefix("torch."),
            "greedy_mean_prefix": agreement["mean_common_prefix"], "greedy_full_match": agreement["full_match"],
            **{f"decode_tok_s_{s}": measured["rates"][str(s)] for s in args.slots},
            "rss_mb": measured["rss_bytes"] / 2**20,
            **{f"{k}_mb": v / 2**20 for k, v in measured["memory"].items()},
        })
        print(f"  {name}: done ({precision.dtype}, quantization {precision.quantization})", flush=True)
    if not args.no_transformers:
        rows.append(transformers_bf16(token_ids, reference, targets))
    if Path(args.llamacpp_path, "llama_cpp").is_dir():
        for name, file in llamacpp_files().items():
            rows.append(llamacpp_row(Path(args.llamacpp_path), name, file, token_ids, reference, targets, args.threads))

    print(f"\n{'precision':<16}{'dtype':<10}{'ppl':>8}{'Δppl':>8}{'top1':>8}{'KL':>9}{'prefix':>8}"
          + "".join(f"{'tok/s@' + str(s):>11}" for s in args.slots) + f"{'RSS MB':>9}{'weights MB':>12}")
    for r in rows:
        weights = sum(r.get(f"{k}_mb", 0) for k in ("dense", "quantized", "dense_copies", "stored", "fused_copies"))
        flag = "  (>2% worse)" if r["worse_than_2pct"] else ""
        print(f"{r['precision']:<16}{r['dtype']:<10}{r['perplexity']:>8.3f}{r['perplexity_change']:>+8.2%}"
              f"{r['top1_agreement']:>8.2%}{r['mean_kl']:>9.5f}{r.get('greedy_mean_prefix', float('nan')):>8.1f}"
              + "".join(f"{r.get(f'decode_tok_s_{s}', float('nan')):>11.1f}" for s in args.slots)
              + f"{r.get('rss_mb', float('nan')):>9.0f}{weights:>12.0f}{flag}")
    write_csv(args.out, rows)
    print(f"wrote {args.out}")


def transformers_bf16(token_ids: list[int], reference: torch.Tensor, targets: torch.Tensor) -> dict:
    """transformers' own model in bfloat16 over the same text: the bar for the default's agreement."""
    from transformers import AutoModelForCausalLM

    from nanoserve.model.default import default_model_dir

    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([token_ids])).logits[0, :-1].float()
    return accuracy_row("transformers", "bfloat16", None, compare(reference, logits, targets))


def accuracy_row(name: str, dtype: str, quantization: str | None, report) -> dict:
    """One CSV row's accuracy columns (and the run's context) from an AccuracyReport."""
    return {"precision": name, "dtype": dtype, "quantization": quantization, "positions": report.positions,
            "perplexity": report.perplexity, "perplexity_ref": report.perplexity_ref,
            "perplexity_change": report.perplexity_change, "worse_than_2pct": worse_than(report),
            "top1_agreement": report.top1_agreement, "mean_kl": report.mean_kl,
            "threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "date": time.strftime("%Y-%m-%d")}


LLAMA_CHILD = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

gguf, tokens_path, out_path, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tokens = json.loads(open(tokens_path).read())
llm = Llama(model_path=gguf, n_ctx=len(tokens) + 8, n_batch=512, n_ubatch=512, logits_all=True,
            n_threads=threads, n_threads_batch=threads, verbose=False)
llm.eval(tokens)
np.save(out_path, np.asarray(llm.scores[: len(tokens)], dtype=np.float32))
"""


def llamacpp_files() -> dict[str, Path]:
    """The shipped Q4_1 file, and the f32, BF16 and Q8_0 GGUFs of the same weights where peerbench's
    setup and precision axis have made them (under .peers/)."""
    from benchmarks.peerbench.llamacpp import PEERS_DIR
    from benchmarks.peerbench.precision import PAIRS
    from nanoserve.model.default import gguf_path

    files = {"Q4_1": gguf_path()}
    for name, (file, _, _) in PAIRS.items():
        if file != "shipped" and (PEERS_DIR / file).is_file():
            files[name.upper()] = PEERS_DIR / file
    return files


def llamacpp_row(path: Path, name: str, gguf: Path, token_ids: list[int], reference: torch.Tensor,
                 targets: torch.Tensor, threads: int) -> dict:
    """llama.cpp's own logits on a GGUF file over the same text (a child process with
    llama-cpp-python on its path), scored against nanoserve's float32 like every other row."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        tokens, out = Path(tmp, "tokens.json"), Path(tmp, "logits.npy")
        tokens.write_text(json.dumps(token_ids))
        env = dict(os.environ, PYTHONPATH=str(path))
        proc = subprocess.run([sys.executable, "-c", LLAMA_CHILD, str(gguf), str(tokens), str(out),
                               str(threads)], capture_output=True, text=True, env=env, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"llama-cpp-python child failed:\n{proc.stderr[-3000:]}")
        logits = torch.from_numpy(np.load(out))[:-1]
    report = compare(reference, logits, targets)
    return accuracy_row(f"llama.cpp {name.lower()}", "llama.cpp", name, report)


# --- --file-types: each llama.cpp file type of the default model, beside llama.cpp's own perplexity ---

PERPLEXITY = "llama-perplexity"
CHUNK = 512  # llama-perplexity's -c: each chunk is evaluated from an empty context


def scored_chunks(model, token_ids: list[int], bos: int | None = None, chunk: int = CHUNK,
                  kv_dtype: torch.dtype | str | None = None):
    """llama-perplexity's protocol over nanoserve's logits: the text cut into whole chunks of `chunk`
    tokens, each evaluated alone (its first token replaced by `bos` where the file adds one), and the
    tokens of each chunk's second half scored (position j's logits against token j + 1, j from
    chunk / 2 to chunk - 2). Yields, per chunk, the scored tokens [chunk / 2 - 1] and their
    positions' log-probabilities [chunk / 2 - 1, V] (float32). kv_dtype: the K/V cache's (None: the
    model's dtype, the chunk forwarded whole); given, each chunk is fed CHUNK tokens at a time, so that
    what comes after the first reads the cache back."""
    token_ids = token_ids if bos is None else [bos, *token_ids]
    first = chunk // 2
    for c in range(len(token_ids) // chunk):
        ids = token_ids[c * chunk:(c + 1) * chunk]
        ids = ids if bos is None else [bos, *ids[1:]]
        logits = teacher_forced_logits(model, ids, chunk=chunk if kv_dtype is None else CHUNK, kv_dtype=kv_dtype).double()
        yield torch.tensor(ids[first + 1:]), torch.log_softmax(logits[first:chunk - 1], dim=-1).float()


def chunked_perplexity(model, token_ids: list[int], bos: int | None = None, chunk: int = CHUNK,
                       reference: list[torch.Tensor] | None = None, kv_dtype: torch.dtype | str | None = None) -> dict:
    """Over scored_chunks: the perplexity, the number of chunks, each chunk's log-probabilities
    ("logprobs"), and against `reference` (another model's "logprobs" on the same chunks) the share
    of scored positions whose top token is the same ("top1") and the mean KL(reference || this)."""
    nll, count, logprobs, agree, kl = 0.0, 0, [], 0, 0.0
    for c, (targets, lp) in enumerate(scored_chunks(model, token_ids, bos, chunk, kv_dtype)):
        nll -= lp.double().gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
        logprobs.append(lp)
        if reference is not None:
            ref = reference[c].double()
            agree += (ref.argmax(-1) == lp.argmax(-1)).sum().item()
            kl += (ref.exp() * (ref - lp.double())).sum().item()
    out = {"perplexity": math.exp(nll / count), "chunks": len(logprobs), "logprobs": logprobs}
    if reference is not None:
        out |= {"top1": agree / count, "kl": kl / count}
    return out


def llama_perplexity(gguf: Path, text: Path, threads: int, context: int = CHUNK,
                     flags: tuple[str, ...] = ()) -> tuple[float, int]:
    """llama.cpp's own `llama-perplexity -c context` (and `flags`) on the file and text: its final estimate and chunks."""
    binary = perplexity_binary()
    proc = subprocess.run([str(binary), "-m", str(gguf), "-f", str(text), "-c", str(context), "-b", str(context),
                           "-t", str(threads), *flags], capture_output=True, text=True, timeout=3600)
    out = proc.stdout + proc.stderr
    estimate = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", out)
    if proc.returncode != 0 or not estimate:
        raise RuntimeError(f"{binary.name} on {gguf.name} failed:\n{out[-3000:]}")
    return float(estimate.group(1)), int(chunks.group(1)) if chunks else -1


def perplexity_binary() -> Path:
    from benchmarks.peerbench.llamacpp import BATCHED_BENCH

    return BATCHED_BENCH.parent / PERPLEXITY


# How nanoserve scores each file: its weights dequantized exactly into float32 matmuls, and as the
# engine serves it by default (a quantized file's K-quants on file-bit panels, x rounded to int8 per
# block of 32; the plan's dtype), which is what a user's prompts and decode steps compute.
FILE_MODES = {"float32 dequantized": {"dtype": "float32", "quantization": None}, "as served": {}}


def file_types(names: list[str], threads: int, out: str) -> None:
    """Each file's perplexity on data/quantbench.txt by nanoserve (FILE_MODES: dequantized into
    float32, and as served) and by llama-perplexity, same protocol; and nanoserve's top-1 agreement
    and mean KL against the f32 file's float32 log-probabilities, position by position."""
    from benchmarks.peerbench.precision import gguf_files
    from nanoserve.model.gguf import read_gguf_file

    files = gguf_files(["f32", *names])
    rows = []
    print(f"quantbench --file-types: perplexity over {TEXT.name} in chunks of {CHUNK} (llama-perplexity's "
          f"protocol), {threads} threads")
    reference = None
    for name, file in files.items():
        theirs, their_chunks = llama_perplexity(file, TEXT, threads)
        metadata = read_gguf_file(file).metadata
        bos = metadata.get("tokenizer.ggml.bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
        for mode, settings in FILE_MODES.items():
            if name == "f32" and mode != "float32 dequantized":
                continue  # the reference: served, a dense file is merely cast to the plan's dtype
            engine = Engine.from_pretrained(file, EngineConfig(max_model_len=CHUNK + 8, **settings))
            token_ids = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)
            plan = f"{engine.plan.dtype}/{engine.plan.quantization}"
            scored = chunked_perplexity(engine.model, token_ids, bos,
                                        reference=None if reference is None else reference["logprobs"])
            del engine
            ours, chunks = scored["perplexity"], scored["chunks"]
            reference = reference or scored
            top1, kl = scored.get("top1", 1.0), scored.get("kl", 0.0)
            rows.append({"file": name, "gguf": file.name, "nanoserve_as": mode, "plan": plan,
                         "nanoserve_perplexity": ours, "llamacpp_perplexity": theirs,
                         "nanoserve_over_llamacpp": ours / theirs - 1, "nanoserve_chunks": chunks,
                         "llamacpp_chunks": their_chunks, "change_from_f32": ours / reference["perplexity"] - 1,
                         "top1_agreement_with_f32": top1, "mean_kl_from_f32": kl,
                         "threads": threads, "date": time.strftime("%Y-%m-%d")})
            print(f"  {name:<8} {mode:<20} ({plan}) nanoserve {ours:.4f} ({chunks} chunks)  llama.cpp {theirs:.4f} "
                  f"({their_chunks} chunks)  {ours / theirs - 1:+.3%}  vs f32 {ours / reference['perplexity'] - 1:+.2%}, "
                  f"top-1 {top1:.2%}, KL {kl:.5f}", flush=True)
    write_csv(out, rows)
    print(f"wrote {out}")



# --- --kv-cache-dtype: a quantized K/V cache against the float16 cache at a long context ---

# nanoserve's kv_cache_dtype -> llama.cpp's -ctk / -ctv
KV_CACHE_TYPES = {"q8_0": "q8_0", "q4_0": "q4_0"}


def kv_caches(kinds: list[str], context: int, file: Path | None, threads: int, out: str,
              tokens: int | None = None) -> None:
    """Each cache kind's perplexity over data/quantbench.txt in windows of `context` tokens, its top-1
    agreement and mean KL against the float16 cache's log-probabilities on the same weights (the plan's
    own choices otherwise), and llama-perplexity's with the same cache types on the same file."""
    from nanoserve.model.default import gguf_path
    from nanoserve.model.gguf import read_gguf_file

    gguf = file or gguf_path()
    metadata = read_gguf_file(gguf).metadata
    bos = metadata.get("tokenizer.ggml.bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
    llama = perplexity_binary().is_file()
    print(f"quantbench --kv-cache-dtype: {gguf.name}, windows of {context} tokens of {TEXT.name}, {threads} threads; "
          f"llama-perplexity {'beside' if llama else 'not built: skipped'}")
    rows, reference = [], None
    for kind in ["float16", *kinds]:
        engine = Engine.from_pretrained(gguf, EngineConfig(max_model_len=context + 8, kv_cache_dtype=kind))
        token_ids = engine.tokenizer.encode(TEXT.read_text(), add_special_tokens=False)[:tokens]
        scored = chunked_perplexity(engine.model, token_ids, bos, context,
                                    None if reference is None else reference["logprobs"], kv_dtype=engine.kv.dtype)
        plan = f"{engine.plan.dtype}/{engine.plan.quantization}"
        del engine
        reference = reference or scored
        cache_type = KV_CACHE_TYPES.get(kind, "f16")
        flags = ("-fa", "on", "-ctk", cache_type, "-ctv", cache_type, "--chunks", str(scored["chunks"]))
        theirs, their_chunks = llama_perplexity(gguf, TEXT, threads, context, flags) if llama else (float("nan"), 0)
        top1, kl = scored.get("top1", 1.0), scored.get("kl", 0.0)
        rows.append({"gguf": gguf.name, "kv_cache": kind, "context": context, "plan": plan,
                     "nanoserve_perplexity": scored["perplexity"], "nanoserve_chunks": scored["chunks"],
                     "change_from_float16": scored["perplexity"] / reference["perplexity"] - 1,
                     "top1_agreement_with_float16": top1, "mean_kl_from_float16": kl,
                     "llamacpp_perplexity": theirs, "llamacpp_chunks": their_chunks,
                     "threads": threads, "date": time.strftime("%Y-%m-%d")})
        print(f"  {kind:<8} nanoserve {scored['perplexity']:.4f} ({scored['chunks']} windows, {plan}), vs float16 "
              f"{rows[-1]['change_from_float16']:+.3%}, top-1 {top1:.2%}, KL {kl:.5f}; llama.cpp -ctk/-ctv "
              f"{cache_type}: {theirs:.4f} ({their_chunks} chunks)", flush=True)
    write_csv(out, rows)
    print(f"wrote {out}")


# --- --model: nanoserve's distributions against llama.cpp's own on the same file, windows and tokens ---

LOGITS_MAGIC = b"_logits_"
KL_FLOOR = -16.0  # llama-perplexity's KL takes the base's log-probabilities above this only


@dataclass(frozen=True)
class LlamaLogProbs:
    """A file llama-perplexity writes with --kl-divergence-base (tools/perplexity/perplexity.cpp): after
    "_logits_", int32 n_ctx, n_vocab and n_chunk, the n_chunk x n_ctx int32 tokens it evaluated (as
    tokenized, BOS first where the file adds one; each window's first token is replaced by BOS when
    evaluated), then for each window its n_ctx - 1 - n_ctx / 2 scored positions, each a row of
    nv = 2 * ((n_vocab + 1) // 2) + 4 uint16: two float32 (scale, min_log_prob), then a code q per
    token, the log-probability min_log_prob + scale * q (the logits more than 16 below the top one
    all at min_log_prob), padded to an even count."""

    path: Path
    context: int  # n_ctx: a window's tokens
    vocab_size: int  # n_vocab
    num_chunks: int  # n_chunk: windows
    tokens: list[int]  # [n_chunk * n_ctx]

    @property
    def scored(self) -> int:
        """Scored positions a window: its logits at n_ctx / 2 .. n_ctx - 2."""
        return self.context - 1 - self.context // 2

    @property
    def row_width(self) -> int:
        return 2 * ((self.vocab_size + 1) // 2) + 4  # nv, in uint16

    @classmethod
    def read(cls, path: Path) -> LlamaLogProbs:
        """The header and tokens of `path`; ValueError where it is not such a file or its size is not
        what its header says."""
        import numpy as np

        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(20)
            if len(head) < 20 or head[:8] != LOGITS_MAGIC:
                raise ValueError(f"{path} does not start with {LOGITS_MAGIC!r} and three int32: not llama-perplexity's "
                                 "--kl-divergence-base file")
            context, vocab_size, num_chunks = np.frombuffer(head[8:], dtype="<i4").tolist()
            if context < 4 or vocab_size < 1 or num_chunks < 1:
                raise ValueError(f"{path}: n_ctx={context}, n_vocab={vocab_size}, n_chunk={num_chunks} "
                                 "(need n_ctx >= 4, n_vocab >= 1, n_chunk >= 1)")
            found = cls(path, context, vocab_size, num_chunks, [])
            want = 20 + 4 * num_chunks * context + 2 * num_chunks * found.scored * found.row_width
            if size != want:
                raise ValueError(f"{path} holds {size} bytes; its header (n_ctx={context}, n_vocab={vocab_size}, "
                                 f"n_chunk={num_chunks}) says {want}")
            tokens = np.frombuffer(f.read(4 * num_chunks * context), dtype="<i4").tolist()
        return cls(path, context, vocab_size, num_chunks, tokens)

    def chunk(self, c: int) -> torch.Tensor:
        """Window c's log-probabilities as llama.cpp decodes them: [scored, n_vocab] float32."""
        import numpy as np

        if not 0 <= c < self.num_chunks:
            raise ValueError(f"window {c} is outside [0, {self.num_chunks})")
        offset = 20 + 4 * self.num_chunks * self.context + 2 * c * self.scored * self.row_width
        rows = np.fromfile(self.path, dtype="<u2", count=self.scored * self.row_width, offset=offset)
        rows = rows.reshape(self.scored, self.row_width)
        scale_min = np.ascontiguousarray(rows[:, :4]).view("<f4")  # [scored, 2]: scale, min_log_prob
        codes = torch.from_numpy(rows[:, 4:4 + self.vocab_size].astype(np.float32))  # [scored, V]
        scale, low = torch.from_numpy(scale_min[:, :1].copy()), torch.from_numpy(scale_min[:, 1:].copy())
        return scale * codes + low


def against_llamacpp(file: Path, context: int, chunks: int, threads: int,
                     config: EngineConfig | None = None) -> dict:
    """llama-perplexity on `file` (-c context, --chunks chunks) saving its log-probabilities, then
    nanoserve (Engine.from_pretrained(file, config): the plan's choices where config is None) over
    the same windows of the same tokens (llama.cpp's own tokenization), position by position:
    both perplexities (llama.cpp's as it printed it, and from its saved log-probabilities), the
    mean KL(llama.cpp || nanoserve) and the share of positions whose top token is the same, both as
    `llama-perplexity --kl-divergence` computes them, and each side's mean top-1 probability (near
    1 / V where the logits are flat)."""
    import tempfile

    from nanoserve.model.gguf import read_gguf_file

    metadata = read_gguf_file(file).metadata
    bos = metadata.get("tokenizer.ggml.bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp, "logprobs.bin")
        theirs, their_chunks = llama_perplexity(file, TEXT, threads, context,
                                                ("--kl-divergence-base", str(base), "--chunks", str(chunks)))
        saved = LlamaLogProbs.read(base)
        if saved.context != context or saved.num_chunks != their_chunks:
            raise RuntimeError(f"{base.name}: n_ctx {saved.context}, {saved.num_chunks} windows; asked for {context}, "
                               f"llama-perplexity said {their_chunks}")
        if bos is not None and saved.tokens[0] != bos:
            raise RuntimeError(f"llama.cpp's tokens start with {saved.tokens[0]}, not the file's BOS {bos}")
        engine = Engine.from_pretrained(file, config or EngineConfig(max_model_len=context + 8))
        plan = f"{engine.plan.dtype}/{engine.plan.quantization}"
        # scored_chunks puts the BOS before the text itself: llama.cpp's tokens hold it already
        text = saved.tokens[1:] if bos is not None else saved.tokens
        nll = nll_base = kl = 0.0
        agree = count = 0
        top_prob = top_prob_base = spread = 0.0
        for c, (targets, logprobs) in enumerate(scored_chunks(engine.model, text, bos, context)):
            ours, base_lp = logprobs.double(), saved.chunk(c).double()  # [n, V] each
            picked = targets.unsqueeze(1)  # [n, 1]
            nll -= ours.gather(1, picked).sum().item()
            nll_base -= base_lp.gather(1, picked).sum().item()
            kept = base_lp > KL_FLOOR
            kl += torch.where(kept, base_lp.exp() * (base_lp - ours), 0.0).sum().item()
            agree += (ours.argmax(-1) == base_lp.argmax(-1)).sum().item()
            top_prob += ours.max(-1).values.exp().sum().item()
            top_prob_base += base_lp.max(-1).values.exp().sum().item()
            # how far llama.cpp's distributions are from flat: the KL a model ignoring its input would score
            spread += torch.where(kept, base_lp.exp() * (base_lp + math.log(saved.vocab_size)), 0.0).sum().item()
            count += len(targets)
        del engine
    return {"gguf": file.name, "plan": plan, "context": context, "windows": saved.num_chunks, "positions": count,
            "nanoserve_perplexity": math.exp(nll / count), "llamacpp_perplexity": theirs,
            "llamacpp_perplexity_saved": math.exp(nll_base / count), "mean_kl": kl / count,
            "top1_agreement": agree / count, "nanoserve_top1_prob": top_prob / count,
            "llamacpp_top1_prob": top_prob_base / count,
            "llamacpp_kl_from_uniform": spread / count, "vocab_size": saved.vocab_size,
            "threads": threads, "date": time.strftime("%Y-%m-%d")}


def models(files: list[Path], context: int, chunks: int, threads: int, out: str) -> None:
    """against_llamacpp on each file, one CSV row each."""
    print(f"quantbench --model: nanoserve against llama-perplexity on the same file, {chunks} windows of {context} "
          f"tokens of {TEXT.name} (each window's second half scored), {threads} threads")
    rows = []
    for file in files:
        row = against_llamacpp(file, context, chunks, threads)
        rows.append(row)
        print(f"  {file.name} ({row['plan']}): nanoserve {row['nanoserve_perplexity']:.4f}, llama.cpp "
              f"{row['llamacpp_perplexity']:.4f} (saved {row['llamacpp_perplexity_saved']:.4f}); mean KL "
              f"{row['mean_kl']:.5f}, top-1 {row['top1_agreement']:.2%} over {row['positions']} positions; top-1 "
              f"probability {row['nanoserve_top1_prob']:.4f} / {row['llamacpp_top1_prob']:.4f}, llama.cpp's KL from uniform "
              f"{row['llamacpp_kl_from_uniform']:.4f}", flush=True)
    write_csv(out, rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
