"""dtype="auto" and quantization="auto": the choice follows the probe's figures, faked both ways."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_hf_llama, nanoserve_model_from_hf

from nanoserve import Engine, EngineConfig
from nanoserve.model import blockdot, precision
from nanoserve.model.precision import Probe, probe_cpu, resolve

CPU = torch.device("cpu")


def fake(float32_ms, bfloat16_ms, int4_ms=1.0, dense_ms=2.0, blockdot_ms=None, wide_ms=(None, None), quantized_ms=None,
         dequantized_rows=(), dense_kernels_ms=(None, None)):
    """A probe's figures as given; the streamed one-row quantized time, unless given, the in-cache
    time of the kernel kernels="auto" picks."""
    if quantized_ms is None:
        quantized_ms = blockdot_ms if precision.auto_kernel(int4_ms, blockdot_ms) == "blockdot" else int4_ms

    def probe(kernel_dtype=None):
        chosen = kernel_dtype or ("bfloat16" if bfloat16_ms < float32_ms else "float32")
        return Probe(float32_ms=float32_ms, bfloat16_ms=bfloat16_ms, int4_ms=int4_ms, kernel_dtype=chosen,
                     shape=(16, 512, 1024), blockdot_ms=blockdot_ms, blockdot_note="" if blockdot_ms else "not built (faked)",
                     quantized_ms=quantized_ms, dense_ms=dense_ms, blockdot_wide_ms=wide_ms[0], dense_wide_ms=wide_ms[1],
                     stream_mb=64.0, dequantized_rows=dequantized_rows, dense_torch_ms=dense_kernels_ms[0],
                     dense_panels_ms=dense_kernels_ms[1])
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


def test_keeping_the_blocks_follows_the_streamed_timing_not_the_one_in_cache():
    # An AVX2 Zen 3's figures (one thread): in cache blockdot 0.055 ms against dense float32 0.054 (a
    # tie that once dequantized the default model); streamed from 64 MB, 0.060 against 0.141.
    kept = resolve("auto", "auto", CPU, True, probe=fake(0.31, 1.7, int4_ms=1.02, blockdot_ms=0.055, quantized_ms=0.060,
                                                     dense_ms=0.141))
    assert (kept.dtype, kept.quantization, kept.kernels) == ("float32", "keep", "blockdot")
    assert "blockdot's int4 2.35x the dense matmul's speed at one row, streamed" in kept.reason
    lost = resolve("auto", "auto", CPU, True, probe=fake(0.31, 1.7, int4_ms=1.02, blockdot_ms=0.01, quantized_ms=0.2,
                                                     dense_ms=0.14))
    assert lost.quantization is None and "dequantized: blockdot's int4 0.70x" in lost.reason


def test_explicit_values_are_taken_without_a_probe():
    def no_probe(**_):
        raise AssertionError("an explicit dtype needs no probe")
    chosen = resolve("float32", "int4", CPU, False, probe=no_probe, kernels="torch", dense_kernel="torch")
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


ZEN3_LADDER = ((16, 0.251, 0.440), (32, 0.492, 0.606), (64, 0.973, 0.945))  # an AVX2 Zen 3's probe, in ms


def kernel_rows(ladder=(), wide_ms=(None, None), **kw):
    return resolve("auto", "auto", CPU, True, probe=fake(0.2, 14.0, dense_ms=0.02, blockdot_ms=0.01, wide_ms=wide_ms,
                                                         dequantized_rows=ladder), **kw)


def test_auto_kernel_rows_follow_the_probes_wide_timing():
    # without dense copies: the widest row count where blockdot is within the margin of the dequantized matmul
    zen3 = kernel_rows(ZEN3_LADDER)
    assert zen3.max_kernel_rows == 64
    assert "kernels up to 64 rows: blockdot 1.75x, 1.23x, 0.97x the dequantized matmul's speed at 16, 32, 64 rows" in zen3.reason
    past_margin = kernel_rows(ZEN3_LADDER[:2] + ((64, 0.945 * precision.WIDE_MARGIN * 1.01, 0.945),))
    assert past_margin.max_kernel_rows == 32
    # the first loss ends the ladder, a win past it notwithstanding
    gap = kernel_rows(((16, 0.2, 0.4), (32, 0.9, 0.6), (64, 0.9, 1.0)))
    assert gap.max_kernel_rows == 16
    lost = kernel_rows(((16, 0.6, 0.4), (32, 0.5, 0.6), (64, 0.9, 1.0)), dense_copies=False)
    assert lost.max_kernel_rows == precision.DEFAULT_KERNEL_ROWS == 8 and "kernels up to 8 rows: blockdot 0.67x" in lost.reason
    # with dense copies: blockdot against the streamed copy at the probe's 16 rows, no margin
    copies = kernel_rows(ZEN3_LADDER, wide_ms=(0.3, 0.4), dense_copies=True)
    assert copies.max_kernel_rows == 16 and "blockdot 1.33x the dense copy's speed at 16 rows, streamed" in copies.reason
    slower = kernel_rows(ZEN3_LADDER, wide_ms=(0.45, 0.4), dense_copies=True)
    assert slower.max_kernel_rows == 8
    assert kernel_rows(ZEN3_LADDER, max_kernel_rows=4).max_kernel_rows == 4
    torch_kernels = resolve("bfloat16", "int4", CPU, False, probe=fake(0.2, 0.05, blockdot_ms=0.01, dequantized_rows=ZEN3_LADDER),
                            kernels="torch")
    assert torch_kernels.max_kernel_rows == 8  # the probe's wide timings are blockdot's
    assert torch_kernels.dense_copies  # and torch's kernels have no dequantizing of their own


def test_auto_dense_copies_only_where_dense_outruns_blockdot_at_decode_widths():
    lean = kernel_rows(ZEN3_LADDER, wide_ms=(0.3, 0.4))  # blockdot holds through 64 rows: no copies
    assert (lean.dense_copies, lean.max_kernel_rows) == (False, 64) and "dense copies none: blockdot 1.75x" in lean.reason
    # blockdot loses at 16 rows (a CPU with fast dense bf16): every 9+ row decode step would dequantize, so copies
    fast_dense = kernel_rows(((16, 0.6, 0.4), (32, 1.0, 0.6), (64, 2.0, 1.0)), wide_ms=(0.6, 0.3))
    assert (fast_dense.dense_copies, fast_dense.max_kernel_rows) == (True, 8)
    assert "dense copies kept: blockdot 0.67x" in fast_dense.reason and "0.50x the dense copy's speed" in fast_dense.reason
    given = kernel_rows(((16, 0.6, 0.4),), wide_ms=(0.6, 0.3), dense_copies=False)
    assert (given.dense_copies, given.max_kernel_rows) == (False, 8)


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
    assert min(figures.float32_ms, figures.bfloat16_ms, figures.int4_ms, figures.dense_ms, figures.quantized_ms) > 0
    assert figures.kernel_dtype in ("float32", "bfloat16") and "float32" in figures.describe()
    # the streamed set outgrows the last-level cache (twice it, within the bounds)
    assert figures.stream_mb * 2**20 >= min(2 * precision.cache_bytes(), precision.STREAM_MAX)
    assert f"streamed from {figures.stream_mb:.0f} MB" in figures.describe()


def test_the_cache_size_is_read_from_sysfs(tmp_path):
    for index, size in (("index0", "32K"), ("index2", "512K"), ("index3", "32768K")):
        (tmp_path / index).mkdir()
        (tmp_path / index / "size").write_text(size + "\n")
    assert precision.cache_bytes(tmp_path) == 32 * 2**20
    assert precision.cache_bytes(tmp_path / "none") == 32 * 2**20  # nothing said: the fallback
    (tmp_path / "index3" / "size").write_text("1G\n")
    assert precision.cache_bytes(tmp_path) == 2**30


def test_the_engine_reports_and_logs_its_choice(monkeypatch, caplog):
    monkeypatch.setattr(precision, "probe_cpu", fake(0.2, 14.0))
    model = nanoserve_model_from_hf(make_hf_llama(seed=1))
    with caplog.at_level(logging.INFO, logger="nanoserve"):
        engine = Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert (engine.plan.dtype, engine.model.dtype) == ("float32", torch.float32)
    logged = [r.message for r in caplog.records if "execution plan" in r.message]
    assert len(logged) == 1 and engine.plan.render() in logged[0] and "dtype float32: bfloat16 0.01x" in logged[0]
    monkeypatch.setattr(precision, "probe_cpu", fake(0.2, 0.05))
    engine = Engine(model, None, EngineConfig(num_kv_blocks=8))
    assert (engine.plan.dtype, engine.model.dtype, engine.kv.k.dtype) == ("bfloat16",) + (torch.bfloat16,) * 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_auto_dense_kernel_follows_the_probe_both_ways(dtype):
    if blockdot.library() is None:
        pytest.skip(f"blockdot not built here: {blockdot.failure()}")
    panels = resolve(dtype, None, CPU, False, probe=fake(0.2, 0.3, dense_kernels_ms=(1.3, 1.0)))
    assert panels.dense_kernel == "blockdot" and "dense kernel blockdot: blockdot's dense panels 1.30x torch's speed at 64 rows" in panels.reason
    on_torch = resolve(dtype, None, CPU, False, probe=fake(0.2, 0.3, dense_kernels_ms=(0.5, 1.0)))
    assert on_torch.dense_kernel == "torch" and "dense kernel torch: blockdot's dense panels 0.50x" in on_torch.reason
    untimed = resolve(dtype, None, CPU, False, probe=fake(0.2, 0.3))  # no figure (no build): torch's
    assert untimed.dense_kernel == "torch"
    given = resolve(dtype, None, CPU, False, probe=fake(0.2, 0.3, dense_kernels_ms=(0.5, 1.0)), dense_kernel="blockdot")
    assert given.dense_kernel == "blockdot" and "dense kernel blockdot: as configured" in given.reason


def test_dense_kernel_refusals():
    with pytest.raises(ValueError, match="dense_kernel='mkl' is not one of \\['auto', 'torch', 'blockdot'\\]"):
        resolve("float32", None, CPU, False, probe=fake(0.2, 0.3), dense_kernel="mkl")
    assert resolve("float16", None, CPU, False, probe=fake(0.2, 0.3)).dense_kernel == "torch"  # panels hold no fp16


@pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")
def test_auto_kv_cache_is_float16_only_for_quantized_weights_on_blockdot_in_float32(monkeypatch):
    # Half float32's bytes where the fused decode widens float16 K/V in vectors; the dtype's
    # elsewhere: the exact path (dense float32), bf16, the per-operation path, a plain-C build.
    figures = fake(0.31, 1.7, int4_ms=1.02, blockdot_ms=0.055, quantized_ms=0.060, dense_ms=0.141)
    kept = resolve("auto", "auto", CPU, True, probe=figures)
    assert (kept.quantization, kept.kernels, kept.kv_cache_dtype) == ("keep", "blockdot", "float16")
    assert "kv cache float16: quantized weights on blockdot in float32" in kept.reason
    assert resolve("float32", None, CPU, True, probe=figures).kv_cache_dtype == "float32"
    assert resolve("bfloat16", "int4", CPU, False, probe=figures).kv_cache_dtype == "bfloat16"
    assert resolve("auto", "auto", CPU, True, probe=figures, fused_decode=False).kv_cache_dtype == "float32"
    assert resolve("float32", "int4", CPU, False, probe=figures, kernels="torch").kv_cache_dtype == "float32"
    assert resolve("float32", None, CPU, False, probe=figures, kv_cache_dtype="float16").kv_cache_dtype == "float16"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not one of \['auto', 'float32'"):
        resolve("float32", None, CPU, False, probe=figures, kv_cache_dtype="int8")
    plain = blockdot.Library(blockdot.library().lib, 0, blockdot.library().path)  # a build without vectors
    monkeypatch.setattr(blockdot, "library", lambda: plain)
    assert resolve("auto", "auto", CPU, True, probe=figures).kv_cache_dtype == "float32"


def test_the_engine_allocates_its_cache_in_the_precisions_kv_dtype():
    hf = make_hf_llama(seed=3)
    exact = Engine(nanoserve_model_from_hf(hf), None, EngineConfig(dtype="float32", quantization=None, num_kv_blocks=8))
    assert exact.kv.k.dtype == torch.float32 and exact.plan.kv_cache_dtype == "float32"
    asked = Engine(nanoserve_model_from_hf(hf), None, EngineConfig(dtype="float32", quantization=None, num_kv_blocks=8,
                                                                   kv_cache_dtype="float16"))
    assert asked.kv.k.dtype == torch.float16 and "kv cache float16: as configured" in asked.plan.reason
