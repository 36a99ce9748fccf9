"""The llama.cpp peers: setting them up once under .peers/ (sdist, f32 GGUF, llama-batched-bench),
llama-cpp-python as a worker, and llama-batched-bench run and parsed; and the smaller set-up the
tests need (`python -m benchmarks.peerbench.llamacpp --setup-quantize`: the sdist's converter and
llama-quantize only).

.peers/ is $NANOSERVE_PEERS where that is set (CI keeps it outside the clone, so a build outlives it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.peerbench.launcher import ROOT, run_child
from benchmarks.peerbench.measured import LLAMA_BATCHED, LLAMA_PY, Measured, error_text, log

# listed in .git/info/exclude: sdist, GGUF and llama.cpp build live here
PEERS_DIR = Path(os.environ.get("NANOSERVE_PEERS") or ROOT / ".peers")
GGUF_NAME = "smollm2-135m-f32.gguf"
BATCHED_BENCH = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-batched-bench"
IK_BATCHED_BENCH = PEERS_DIR / "ik_llama.cpp-build" / "bin" / "llama-batched-bench"
IK_LLAMA_CPP_REPO = "https://github.com/ikawrakow/ik_llama.cpp"
# Native, but without AMX tiles: on a Xeon with AMX, llama.cpp's AMX matmul died here on its first
# tile instruction (SIGILL at ldtilecfg), while torch's oneDNN ran AMX in the same sandbox. The notes
# say so beside every llama.cpp figure from such a machine.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
# The release whose vendored llama.cpp the notes' figures and tests/test_llamacpp_files.py were made with.
LLAMA_CPP_VERSION = "0.3.36"
LLAMA_CPP_SDIST = f"llama-cpp-python=={LLAMA_CPP_VERSION}"
QUANTIZE = PEERS_DIR / "llama.cpp-build" / "bin" / "llama-quantize"


def has_module(name: str) -> bool:
    """Whether `name` can be imported here, without importing it."""
    return importlib.util.find_spec(name) is not None


def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """The JSONL rows of `llama-batched-bench --output-format jsonl` found in its output."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"pl"' in line:
            rows.append(json.loads(line))
    return rows


def worker_llama_py(task: dict[str, Any]) -> list[Measured]:
    """llama.cpp through llama-cpp-python, greedy, one request at a time, f32 weights and KV cache."""
    import llama_cpp
    from llama_cpp import Llama

    from nanoserve.instruments.baseline import check_serial
    from nanoserve.instruments.runners import run_serial

    f32 = getattr(llama_cpp, "GGML_TYPE_F32", 0)
    llm = Llama(
        model_path=task["gguf"], n_ctx=task["max_model_len"], n_batch=512, n_ubatch=512,
        n_threads=task["threads"], n_threads_batch=task["threads"], type_k=f32, type_v=f32, seed=0, verbose=False,
    )

    def generate_one(prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], float | None]:
        llm.reset()
        tokens: list[int] = []
        first = None
        for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            if first is None:
                first = time.perf_counter()
            tokens.append(int(token))
            if len(tokens) >= max_new_tokens:
                break
        return tokens, first

    out = []
    for name, wl in task["workloads"].items():
        k = min(task["serial_requests"], len(wl["prompts"]))
        generate_one(wl["prompts"][0], 4)  # warm-up, uncounted
        log(f"llama-cpp-python {name} serial x{k}")
        m = Measured(workload=name, system=LLAMA_PY, concurrency=1, note="f32 GGUF, f32 KV")
        try:
            m.run = check_serial(run_serial(generate_one, wl["prompts"][:k], wl["output_lens"][:k], system=LLAMA_PY))
            m.steps = m.run.output_tokens
        except Exception as e:
            m.error = error_text(e)
        out.append(m)
    return out


def run_batched_bench(
    binary: Path, gguf: Path, shapes: dict[str, tuple[int, int]], concurrency: Sequence[int], threads: int,
    timeout_s: float,
) -> tuple[list[Measured], float]:
    """llama-batched-bench once per workload shape (equal lengths), f32 KV; returns rows and peak RSS."""
    out: list[Measured] = []
    peak = 0.0
    for name, (pp, tg) in shapes.items():
        npl = sorted(set(concurrency))
        cmd = [
            str(binary), "-m", str(gguf), "-c", str(max(npl) * (pp + tg)), "-b", "2048", "-ub", "512",
            "-npp", str(pp), "-ntg", str(tg), "-npl", ",".join(map(str, npl)), "-t", str(threads), "-tb", str(threads),
            "-ctk", "f32", "-ctv", "f32", "--output-format", "jsonl",
        ]
        log(f"llama-batched-bench {name} pp={pp} tg={tg} npl={npl}")
        child = run_child(cmd, timeout_s, None)
        peak = max(peak, child.peak_rss_mib)
        rows = {int(r["pl"]): r for r in parse_batched_bench(child.result or "")}
        note = "equal lengths" if name == "offline" else f"equal-length stand-in at the ragged means pp={pp} tg={tg}"
        for pl in npl:
            m = Measured(workload=name, system=LLAMA_BATCHED, concurrency=pl, note=note)
            r = rows.get(pl)
            if r is None:
                m.error = child.error or "no result row for this number of sequences"
            else:
                m.output_tokens, m.prompt_tokens = pl * tg, pl * pp
                m.wall_s, m.ttft_s, m.tpot_s = float(r["t"]), float(r["t_pp"]), float(r["t_tg"]) / tg
                m.steps = tg
            out.append(m)
    return out, peak


def setup_llamacpp(python: str = sys.executable) -> None:
    """Once: fetch the llama-cpp-python sdist, write the f32 GGUF, build llama-batched-bench (all under .peers/).

    Does not `pip install llama-cpp-python` (a change to the environment, several minutes of
    compiling); prints the command instead.
    """
    from nanoserve.model.default import default_model_dir

    sdist, vendor = fetch_sdist(python)
    gguf = PEERS_DIR / GGUF_NAME
    if not gguf.is_file():
        pylib = install_pylib(python)
        env = os.environ | {"PYTHONPATH": f"{vendor / 'gguf-py'}{os.pathsep}{pylib}"}
        subprocess.run([python, str(vendor / "convert_hf_to_gguf.py"), str(default_model_dir()), "--outtype", "f32",
                        "--outfile", str(gguf)], check=True, env=env)
    if not BATCHED_BENCH.is_file():
        build_batched_bench(vendor, BATCHED_BENCH.parent.parent, ["llama-quantize"])
    print(f"GGUF: {gguf}\nllama-batched-bench: {BATCHED_BENCH}")
    print("llama-cpp-python (optional, compiles llama.cpp for minutes): "
          f"CMAKE_ARGS=-DGGML_NATIVE=ON {python} -m pip install {sdist}")


def convert_checkpoint(folder: Path, outfile: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py (the sdist's, its gguf-py and .peers/pylib on the path) on a
    checkpoint folder, writing `outfile` in `outtype` (f32, bf16)."""
    vendor = next(PEERS_DIR.glob("llama_cpp_python-*/vendor/llama.cpp"))
    env = os.environ | {"PYTHONPATH": f"{vendor / 'gguf-py'}{os.pathsep}{PEERS_DIR / 'pylib'}"}
    subprocess.run([sys.executable, str(vendor / "convert_hf_to_gguf.py"), str(folder), "--outtype", outtype,
                    "--outfile", str(outfile)], check=True, env=env)


def setup_quantize(python: str = sys.executable) -> None:
    """Once: what tests/test_llamacpp_files.py needs under PEERS_DIR: the sdist unpacked (its
    convert_hf_to_gguf.py and gguf-py), pylib with sentencepiece, and llama-quantize alone.

    Built for any x86-64 (GGML_NATIVE=OFF), not for this CPU: CI keeps the build in a cache that may
    outlive the machine, and what llama-quantize writes comes from ggml's scalar reference code either way.
    """
    _, vendor = fetch_sdist(python)
    install_pylib(python)
    if not QUANTIZE.is_file():
        build_targets(vendor, QUANTIZE.parent.parent, ["llama-quantize"], ["-DGGML_NATIVE=OFF"])
    print(f"llama.cpp converter: {vendor / 'convert_hf_to_gguf.py'}\nllama-quantize: {QUANTIZE}")


def fetch_sdist(python: str = sys.executable) -> tuple[Path, Path]:
    """The pinned llama-cpp-python sdist, downloaded and unpacked in PEERS_DIR once; returns the
    tarball and its vendored llama.cpp tree."""
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    name = f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    sdist = PEERS_DIR / f"{name}.tar.gz"
    if not sdist.is_file():
        subprocess.run([python, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", LLAMA_CPP_SDIST,
                        "-d", str(PEERS_DIR)], check=True)
    if not (PEERS_DIR / name).is_dir():  # unpacked aside and renamed, so a cut-off unpack is not taken for one
        unpacking = PEERS_DIR / f"{name}.unpacking"
        shutil.rmtree(unpacking, ignore_errors=True)
        unpacking.mkdir()
        subprocess.run(["tar", "xzf", str(sdist), "-C", str(unpacking)], check=True)
        (unpacking / name).rename(PEERS_DIR / name)
        unpacking.rmdir()
    return sdist, PEERS_DIR / name / "vendor" / "llama.cpp"


def install_pylib(python: str = sys.executable) -> Path:
    """PEERS_DIR/pylib with sentencepiece, for the converter, kept out of the venv; returns it."""
    pylib = PEERS_DIR / "pylib"
    if not (pylib / "sentencepiece").is_dir():  # installed aside and renamed, as the sdist is unpacked
        installing = PEERS_DIR / "pylib.installing"
        shutil.rmtree(installing, ignore_errors=True)
        subprocess.run([python, "-m", "pip", "install", "-q", "--target", str(installing), "sentencepiece"], check=True)
        shutil.rmtree(pylib, ignore_errors=True)
        installing.rename(pylib)
    return pylib


def build_batched_bench(src: Path, build: Path, extra_targets: Sequence[str] = (), cmake_args: Sequence[str] = ()) -> None:
    """Configure and build llama-batched-bench (and `extra_targets`) from the llama.cpp tree `src`, for this CPU."""
    build_targets(src, build, ["llama-batched-bench", *extra_targets], ["-DGGML_NATIVE=ON", *cmake_args])


def build_targets(src: Path, build: Path, targets: Sequence[str], cmake_args: Sequence[str] = ()) -> None:
    """Configure (Release, no AMX tiles, no curl, tests or server) and build `targets` from the llama.cpp tree `src`."""
    start = time.perf_counter()
    subprocess.run(["cmake", "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", *cmake_args], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", *targets, "-j", str(os.cpu_count())], check=True)
    print(f"built {', '.join(targets)} in {build / 'bin'} in {time.perf_counter() - start:.0f} s")


def setup_ik_llamacpp(source: str = IK_LLAMA_CPP_REPO) -> None:
    """Once: clone ik_llama.cpp (the fork with the iqk CPU kernels) from `source` and build its
    llama-batched-bench under .peers/ (about half an hour on two cores; the build is kept).

    `source` is anything `git clone` takes: the GitHub address, or a local clone or mirror. The
    flash-attention kernels for quantized K/V caches are left out (GGML_IQK_FA_ALL_QUANTS=OFF): the
    peers run with f16 or f32 caches, and those kernels are much of the build's time.
    """
    PEERS_DIR.mkdir(exist_ok=True)
    src = PEERS_DIR / "ik_llama.cpp"
    if not src.is_dir():
        subprocess.run(["git", "clone", "--depth", "1", source, str(src)], check=True)
    if not IK_BATCHED_BENCH.is_file():
        build_batched_bench(src, IK_BATCHED_BENCH.parent.parent, cmake_args=["-DGGML_IQK_FA_ALL_QUANTS=OFF"])
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    print(f"ik_llama.cpp {commit.stdout.strip()}: {IK_BATCHED_BENCH}")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.peerbench.llamacpp")
    parser.add_argument("--setup-quantize", action="store_true", required=True,
                        help="fetch the sdist, install pylib and build llama-quantize under $NANOSERVE_PEERS "
                             "(default .peers/), what tests/test_llamacpp_files.py needs")
    parser.parse_args()
    setup_quantize()
