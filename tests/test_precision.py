"""dtype="auto" and quantization="auto": the choice follows the probe's figures, faked both ways."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_hf_llama, nanoserve_model_from_hf

from nanoserve import Engine, EngineConfig
from nanoserve.model import precision
from nanoserve.model.precision import Probe, probe_cpu, resolve

CPU = torch.device("cpu")


def fake(float32_ms, bfloat16_ms, int4_ms=1.0, dense_ms=2.0, blockdot_ms=None, wide_ms=(None, None)):
    def probe(kernel_dtype=None):
        chosen = kernel_dtype or ("bfloat16" if bfloat16_ms < float32_ms else "float32")
        return Probe(float32_ms, bfloat16_ms, int4_ms, dense_ms, chosen, (16, 512, 1024), blockdot_ms,
                     "" if blockdot_ms else "not built (faked)", *wide_ms)
    return probe


def test_auto_picks_bfloat16_where_the_probe_times_it_faster():
    chosen = resolve("auto", None, CPU, False, probe=fake(float32_ms=0.16, bfloat16_ms=0.05))
    assert (chosen.dtype, chosen.torch_dtype) == ("bfloat16", torch.bfloat16)
    assert "3.20x float32's speed" in chosen.reason and chosen.probe.bfloat16_ms == 0.05


def test_auto_keeps_float32_where_bfloat16_is_emulated():
    # An AVX2-only CPU: bf16 measured about 70x slower than float32.
    chosen = resolve("auto", None, CPU, False, probe=fake(float32_ms=0.2, bfloat16_ms=14.0))
    assert chosen.dtype == "float32" and "0.01x float32's speed" in chosen.reason


def test_auto_quantization_keeps_the_checkpoints_blocks_only_where_the_kernel_is_faster():
    fast = resolve("auto", "auto", CPU, True, probe=fake(0.16, 0.05, int4_ms=0.02, dense_ms=0.05))
    assert (fast.dtype, fast.quantization) == ("bfloat16", "keep")
    slow = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, int4_ms=0.45, dense_ms=0.02))
    assert (slow.dtype, slow.quantization) == ("float32", None) and "dequantized" in slow.reason
    dense = resolve("auto", "auto", CPU, False, probe=fake(0.16, 0.05))
    assert dense.quantization is None and "not quantized" in dense.reason


def test_explicit_values_are_taken_without_a_probe():
    def no_probe(**_):
        raise AssertionError("an explicit dtype needs no probe")
    chosen = resolve("float32", "int4", CPU, False, probe=no_probe, kernels="torch")
    assert (chosen.dtype, chosen.quantization, chosen.probe, chosen.kernels) == ("float32", "int4", None, "torch")


def test_auto_kernels_keep_blockdot_unless_the_probe_times_torch_clearly_faster():
    # The dtype and quantization given, the probe is still asked, for the kernels alone, in that dtype.
    fast = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, int4_ms=0.06, blockdot_ms=0.03))
    assert fast.kernels == "blockdot" and "kernels blockdot: 2.00x torch's" in fast.reason
    assert fast.probe.kernel_dtype == "bfloat16"
    slow = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, int4_ms=0.03, blockdot_ms=0.06))
    assert slow.kernels == "torch" and "blockdot 0.50x" in slow.reason
    # within the margin blockdot stays (its one-call decode is worth more than the probe's matmul shows)
    near = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, int4_ms=0.05, blockdot_ms=0.06))
    assert near.kernels == "blockdot" and "kernels blockdot: 0.83x" in near.reason
    past = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, int4_ms=0.04, blockdot_ms=0.06))
    assert past.kernels == "torch" and "blockdot 0.67x" in past.reason
    missing = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05))
    assert missing.kernels == "torch" and "not built (faked)" in missing.reason
    dense = resolve("bfloat16", None, CPU, False, probe=fake(0.2, 0.05, blockdot_ms=0.01))
    assert dense.kernels == "torch"  # nothing quantized, nothing for blockdot to run
    int8 = resolve("bfloat16", "int8", CPU, False, probe=fake(0.2, 0.05, blockdot_ms=0.01))
    assert int8.kernels == "torch" and "does not run int8 per channel" in int8.reason
    # blockdot faster than torch's kernel makes keeping a checkpoint's blocks worth it even where
    # torch's kernel alone loses to the dense matmul (an AVX2 CPU: float32 activations)
    kept = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, int4_ms=0.45, dense_ms=0.02, blockdot_ms=0.01))
    assert (kept.dtype, kept.quantization, kept.kernels) == ("float32", "keep", "blockdot")


def test_auto_kernel_rows_follow_the_probes_wide_timing():
    # blockdot faster than dense at the probe's 16 rows (an AVX2 Zen 3): the kernels up to 16 rows
    wide = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, dense_ms=0.02, blockdot_ms=0.01, wide_ms=(0.3, 0.4)))
    assert wide.max_kernel_rows == 16 and "kernels up to 16 rows: blockdot 1.33x" in wide.reason
    narrow = resolve("auto", "auto", CPU, True, probe=fake(0.16, 0.05, int4_ms=0.02, dense_ms=0.05, blockdot_ms=0.01,
                                                       wide_ms=(0.4, 0.1)))
    assert narrow.max_kernel_rows == precision.DEFAULT_KERNEL_ROWS == 8 and "kernels up to 8 rows: blockdot 0.25x" in narrow.reason
    # within the margin (the probe's matrix is in cache, where dense's larger reads cost nothing)
    near = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, dense_ms=0.02, blockdot_ms=0.01, wide_ms=(0.6, 0.5)))
    assert near.max_kernel_rows == 16
    past = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, dense_ms=0.02, blockdot_ms=0.01, wide_ms=(0.65, 0.5)))
    assert past.max_kernel_rows == 8
    given = resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, dense_ms=0.02, blockdot_ms=0.01, wide_ms=(0.3, 0.4)),
                    max_kernel_rows=4)
    assert given.max_kernel_rows == 4
    torch_kernels = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, blockdot_ms=0.01, wide_ms=(0.3, 0.4)),
                            kernels="torch")
    assert torch_kernels.max_kernel_rows == 8  # the probe's wide timing is blockdot's


def test_bf16_decode_steps_run_in_one_call_at_every_width_where_bf16_is_slower():
    emulated = resolve("bfloat16", None, CPU, False, probe=fake(0.2, 14.0))
    assert emulated.bf16_one_call_rows == 2**31 and "one call at every width: bfloat16 0.01x" in emulated.reason
    native = resolve("bfloat16", None, CPU, False, probe=fake(0.2, 0.05))
    assert native.bf16_one_call_rows == 2 and "one call" not in native.reason


def test_quantization_off_the_cpu_is_refused_by_name():
    with pytest.raises(ValueError, match="quantization='int8' runs on torch's CPU kernels; device='cuda'"):
        resolve("float16", "int8", torch.device("cuda"), False)


def test_the_real_probe_reports_its_figures():
    figures = probe_cpu()
    assert min(figures.float32_ms, figures.bfloat16_ms, figures.int4_ms, figures.dense_ms) > 0
    assert figures.kernel_dtype in ("float32", "bfloat16") and "float32" in figures.describe()


def test_the_engine_reports_and_logs_its_choice(monkeypatch, caplog):
    monkeypatch.setattr(precision, "probe_cpu", fake(0.2, 14.0))
    model = nanoserve_model_from_hf(make_hf_llama(seed=1))
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert (engine.precision.dtype, engine.model.dtype) == ("float32", torch.float32)
    assert any("computing in float32" in r.message and "0.01x" in r.message for r in caplog.records)
    monkeypatch.setattr(precision, "probe_cpu", fake(0.2, 0.05))
    engine = Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert (engine.precision.dtype, engine.model.dtype, engine.kv.k.dtype) == ("bfloat16",) + (torch.bfloat16,) * 2
