"""benchmarks/tpbench.py: the GPU table's arithmetic by hand, and a quick run on a tiny checkpoint
whose per-step counts are known (2 all-reduces a layer, one gather, one plan)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from test_tensor_parallel import tiny_checkpoint

from benchmarks.tpbench import GPU_FIGURES, gpu_rows
from nanoserve.model.config import LlamaConfig

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_rows_by_hand():
    # The default model's shape: E = 576, L = 30.
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    rows = {(r["tp"], r["tokens_per_step"]): r for r in gpu_rows(config, [1, 2048])}
    one = rows[(2, 1)]
    assert (one["all_reduce_bytes"], one["all_reduces_per_step"], one["all_reduce_bytes_per_step"]) == (2304, 60, 138240)
    # t = alpha + S / busbw * 2 (n - 1) / n: at n = 2 the factor is 1.
    assert one["all_reduce_us_low"] == pytest.approx(6.0 + 2304 / 480e9 * 1e6)
    assert one["all_reduce_us_high"] == pytest.approx(10.0 + 2304 / 365e9 * 1e6)
    eight = rows[(8, 2048)]
    assert eight["all_reduce_us_high"] == pytest.approx(33.7 + 4718592 / 365e9 * 1e6 * 1.75)
    assert eight["all_reduce_us_per_step_high"] == pytest.approx(60 * eight["all_reduce_us_high"])
    # 134,515,008 parameters in bf16, split 8 ways, read at 4.8 TB/s.
    assert config.num_params == 134515008
    assert eight["weight_read_us_per_step"] == pytest.approx(2 * 134515008 / 8 / 4.8e12 * 1e6)
    assert GPU_FIGURES["alpha_us_high"][8] == 33.7


def test_quick_run_on_a_tiny_checkpoint(tmp_path):
    path = tiny_checkpoint(tmp_path / "m")  # TINY: 2 layers, E = 32
    out = tmp_path / "tpbench.csv"
    proc = subprocess.run([sys.executable, "benchmarks/tpbench.py", "--model", str(path), "--quick", "--prefill", "16",
                           "--prompt-len", "8", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader(out.open()))
    measured = [r for r in rows if r["bench"] == "measured"]
    assert sorted((r["workload"], r["slots_or_prompt_tokens"], r["tp"]) for r in measured) == sorted(
        (w, s, tp) for w, s in (("decode", "1"), ("decode", "4"), ("prefill", "16")) for tp in ("1", "2"))
    for r in measured:
        if r["tp"] == "2":
            tokens = 16 if r["workload"] == "prefill" else int(r["slots_or_prompt_tokens"])
            assert float(r["all_reduces_per_step"]) == 2 * 2  # 2 layers
            assert float(r["all_reduce_bytes_per_step"]) == 4 * tokens * 32 * 4
    assert {r["tp"] for r in rows if r["bench"] == "gpu_model"} == {"2", "4", "8"}


def test_plans_pair_times_the_torch_plan_against_the_invariant_one(tmp_path):
    path = tiny_checkpoint(tmp_path / "m")
    out = tmp_path / "tpbench.csv"
    proc = subprocess.run([sys.executable, "benchmarks/tpbench.py", "--model", str(path), "--quick", "--prefill", "16",
                           "--prompt-len", "8", "--dtype", "bfloat16", "--pair", "plans", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = [r for r in csv.DictReader(out.open()) if r["bench"] == "measured"]
    drivers = {(r["engine"], r["batch_invariant"], r["tp"], r["driver"]) for r in measured}
    assert drivers == {("TP=2 not invariant", "False", "2", "torch-tensor-parallel"),
                       ("TP=2 as configured", "True", "2", "c-tensor-parallel")}
    assert all(float(r["all_reduces_per_step"]) == 2 * 2 for r in measured)
    for r in measured:
        assert 0.0 <= float(r["greedy_agreement_pair"]) <= 1.0 and 0.0 <= float(r["greedy_agreement_float32"]) <= 1.0
    assert "greedy tokens alike: A and B" in proc.stdout
