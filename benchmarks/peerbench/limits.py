"""The machine's limits, measured in the same run (a GEMM peak, copy and read bandwidth), and the
fractions of them a token rate implies; the model's size read from its safetensors header."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path


def gemm_flops(n: int) -> float:
    """Floating-point operations of an n x n by n x n matmul: n^3 multiply-adds, 2 n^3 flops."""
    if n < 1:
        raise ValueError(f"n={n} must be >= 1")
    return 2.0 * n**3


def copy_traffic_bytes(nbytes: int) -> float:
    """Bytes a copy of `nbytes` moves through memory: each byte is read once and written once."""
    if nbytes < 1:
        raise ValueError(f"nbytes={nbytes} must be >= 1")
    return 2.0 * nbytes


def gemm_fraction(num_params: int, tokens_per_s: float, gemm_flop_per_s: float) -> float:
    """Fraction of the measured GEMM peak implied by a token rate: 2 x params x tokens/s / peak.

    Each token costs one multiply-add per weight in the linear layers (the tied LM head included),
    so 2 x params flops; attention's own flops are left out, which makes this a lower bound.
    """
    if num_params < 1:
        raise ValueError(f"num_params={num_params} must be >= 1")
    if tokens_per_s < 0:
        raise ValueError(f"tokens_per_s={tokens_per_s} must be >= 0")
    if not gemm_flop_per_s > 0:
        raise ValueError(f"gemm_flop_per_s={gemm_flop_per_s} must be > 0")
    return 2.0 * num_params * tokens_per_s / gemm_flop_per_s


def bandwidth_fraction(weight_bytes: int, steps_per_s: float, copy_bytes_per_s: float) -> float:
    """Fraction of the measured copy bandwidth implied by reading every weight once per forward step.

    weight bytes x steps/s / bandwidth; the KV cache and activations are left out (a lower bound).
    """
    if weight_bytes < 1:
        raise ValueError(f"weight_bytes={weight_bytes} must be >= 1")
    if steps_per_s < 0:
        raise ValueError(f"steps_per_s={steps_per_s} must be >= 0")
    if not copy_bytes_per_s > 0:
        raise ValueError(f"copy_bytes_per_s={copy_bytes_per_s} must be > 0")
    return weight_bytes * steps_per_s / copy_bytes_per_s


def safetensors_sizes(path: Path) -> tuple[int, int]:
    """(parameters, bytes) of a safetensors file, read from its header alone."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    params = nbytes = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        params += math.prod(info["shape"])
        start, end = info["data_offsets"]
        nbytes += end - start
    return params, nbytes


def measure_limits(gemm_n: int, copy_mib: int, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` fp32 GEMM flop rate, copy bandwidth (read + write counted) and read-only
    bandwidth (a sum over the same tensor) on this machine, with the bench's threads."""
    import torch

    a = torch.randn(gemm_n, gemm_n)
    b = torch.randn(gemm_n, gemm_n)
    c = torch.empty(gemm_n, gemm_n)
    torch.mm(a, b, out=c)  # warm-up: thread pool and kernel selection
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b, out=c)
        best = min(best, time.perf_counter() - t)
    gemm = gemm_flops(gemm_n) / best
    src = torch.ones(copy_mib * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    copy = copy_traffic_bytes(src.numel() * 4) / best
    src.sum()
    best = math.inf
    for _ in range(repeats):  # a read-only stream, the access pattern of reading weights
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    read = src.numel() * 4 / best
    return {"gemm_flop_per_s": gemm, "gemm_n": gemm_n, "copy_bytes_per_s": copy, "copy_mib": copy_mib,
            "read_bytes_per_s": read}

