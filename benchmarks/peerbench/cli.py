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

Each system runs in its own subprocess (benchmarks/peerbench/workers.py), so its peak resident
memory is its own (the kernel's rusage of that child, read through os.wait4 in a small launcher) and
no allocator state leaks from one system into the next; no two systems ever run at once. A GEMM peak
(a 2048^3 fp32 matmul) and a copy bandwidth (a large tensor copy) are timed in the same run, and
every row says what fraction of them its throughput implies.

Token ids: nanoserve at every slot count must equal transformers `generate` one at a time
(`baseline.compare`; the run exits non-zero otherwise, after writing what it measured). The static
padded batch, continuous batching and llama.cpp may legitimately diverge (other shapes, other
kernels); their first divergence per request is reported in the table and, per request, in
peerbench_divergence.csv, never hidden.

    python -m benchmarks.peerbench                   # the full run (about 35 minutes on 2 cores)
    python -m benchmarks.peerbench --quick           # about 2 minutes: 8 requests, slots 1 4 8
    python -m benchmarks.peerbench --setup-llamacpp  # once: sdist, f32 GGUF, llama-batched-bench under .peers/
    python -m benchmarks.peerbench --setup-ik-llamacpp [SOURCE]  # once: ik_llama.cpp's llama-batched-bench (~30 min)

Writes OUT/peerbench.csv (units in the column names), OUT/peerbench_divergence.csv and, when
matplotlib is installed, OUT/peerbench.png (output tokens/s against concurrency, every system).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.peerbench.launcher import run_worker
from benchmarks.peerbench.limits import safetensors_sizes
from benchmarks.peerbench.llamacpp import (
    BATCHED_BENCH,
    GGUF_NAME,
    IK_LLAMA_CPP_REPO,
    PEERS_DIR,
    has_module,
    run_batched_bench,
    setup_ik_llamacpp,
    setup_llamacpp,
)
from benchmarks.peerbench.measured import LLAMA_BATCHED, LLAMA_PY, SYSTEMS, Measured, log, measured_from_json
from benchmarks.peerbench.report import COLUMNS, add_fractions, build_rows, render_table, write_png
from benchmarks.peerbench.workers import worker_main
from nanoserve.instruments.csv_writer import write_csv
from nanoserve.instruments.load import Workload, offline_workload, ragged_workload


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peerbench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--setup-llamacpp", action="store_true", help="fetch/convert/build the llama.cpp peers, then exit")
    parser.add_argument("--setup-ik-llamacpp", nargs="?", const=IK_LLAMA_CPP_REPO, metavar="SOURCE",
                        help="clone ik_llama.cpp from SOURCE (default: GitHub) and build its llama-batched-bench, then exit")
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
    if args.setup_ik_llamacpp:
        setup_ik_llamacpp(args.setup_ik_llamacpp)
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
        log("limits: GEMM peak and copy bandwidth")
        lim = run_worker("limits", {"threads": args.threads, "gemm_n": 2048, "copy_mib": 256}, tmp, 600)
        if lim.error:
            raise SystemExit(f"could not measure the machine limits: {lim.error}")
        limits = lim.result
        for system in systems:
            if system == LLAMA_PY and not has_module("llama_cpp"):
                skipped.append(f"{LLAMA_PY}: not installed (optional: `python -m benchmarks.peerbench --setup-llamacpp` "
                               "prints the pip command)")
                continue
            gguf = PEERS_DIR / GGUF_NAME
            if system in (LLAMA_PY, LLAMA_BATCHED) and not gguf.is_file():
                skipped.append(f"{system}: no f32 GGUF at {gguf} (run `python -m benchmarks.peerbench --setup-llamacpp`)")
                continue
            if system == LLAMA_BATCHED:
                if not BATCHED_BENCH.is_file():
                    skipped.append(f"{LLAMA_BATCHED}: not built at {BATCHED_BENCH} "
                                   "(run `python -m benchmarks.peerbench --setup-llamacpp`)")
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
            log(f"{system}: starting its subprocess")
            child = run_worker(system, task, tmp, args.timeout)
            log(f"{system}: done in {child.seconds:.0f} s, peak RSS {child.peak_rss_mib:.0f} MiB")
            if child.error:
                m = Measured(workload="all", system=system, concurrency=0, error=f"subprocess {child.error}")
                measured.append((m, child.peak_rss_mib))
                continue
            measured += [(measured_from_json(d), child.peak_rss_mib) for d in child.result]

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
    write_csv(csv_path, rows)
    div_path = out_dir / "peerbench_divergence.csv"
    write_csv(div_path, divergence_rows)
    print()
    print(f"wrote {csv_path} and {div_path}")
    print(write_png([r for r in rows if r["workload"] != "all"], out_dir / "peerbench.png"))
    if failures:
        print()
        for line in failures:
            print(f"GATE FAILED: {line}")
        raise SystemExit(1)

