"""peerbench's arithmetic and reports, checked against values worked out by hand; one slow end-to-end run."""

from __future__ import annotations

import csv
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.peerbench import hf, launcher, limits, llamacpp, report, runs
from benchmarks.peerbench.measured import (
    HF_CB,
    HF_SERIAL,
    HF_STATIC,
    LLAMA_BATCHED,
    LLAMA_PY,
    NANOSERVE,
    Measured,
)
from nanoserve.baseline import RunRecord, SystemRun

ROOT = Path(__file__).resolve().parent.parent

# ---- machine-limit fractions ------------------------------------------------------------------------


def test_gemm_flops_is_two_n_cubed():
    assert limits.gemm_flops(2048) == 17_179_869_184.0  # 2 * 2048**3
    assert limits.gemm_flops(1) == 2.0


def test_copy_traffic_counts_the_read_and_the_write():
    assert limits.copy_traffic_bytes(256 * 2**20) == 536_870_912.0


def test_gemm_fraction_by_hand():
    # 135M params x 2 flops x 100 tok/s = 27 GFLOP/s of a 75 GFLOP/s peak
    assert limits.gemm_fraction(135_000_000, 100.0, 75e9) == pytest.approx(0.36, rel=1e-12)
    # 1M params x 2 x 50 tok/s = 0.1 GFLOP/s of 1 GFLOP/s
    assert limits.gemm_fraction(1_000_000, 50.0, 1e9) == pytest.approx(0.1, rel=1e-12)
    assert limits.gemm_fraction(1_000_000, 0.0, 1e9) == 0.0


def test_bandwidth_fraction_by_hand():
    # 538 MB of weights read 20 times a second = 10.76 GB/s of a 16 GB/s copy
    assert limits.bandwidth_fraction(538_000_000, 20.0, 16e9) == pytest.approx(0.6725, rel=1e-12)
    # at the cap: bandwidth / weight bytes steps per second is exactly 1
    assert limits.bandwidth_fraction(500, 32.0, 16_000.0) == 1.0


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: limits.gemm_fraction(0, 1.0, 1.0), "num_params"),
        (lambda: limits.gemm_fraction(1, -1.0, 1.0), "tokens_per_s"),
        (lambda: limits.gemm_fraction(1, 1.0, 0.0), "gemm_flop_per_s"),
        (lambda: limits.bandwidth_fraction(0, 1.0, 1.0), "weight_bytes"),
        (lambda: limits.bandwidth_fraction(1, -1.0, 1.0), "steps_per_s"),
        (lambda: limits.bandwidth_fraction(1, 1.0, 0.0), "copy_bytes_per_s"),
        (lambda: limits.gemm_flops(0), "n="),
        (lambda: limits.copy_traffic_bytes(0), "nbytes"),
    ],
)
def test_fractions_refuse_impossible_inputs(call, names):
    with pytest.raises(ValueError, match=names):
        call()


def test_safetensors_sizes_reads_the_header(tmp_path):
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [24, 40]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(40))
    assert limits.safetensors_sizes(path) == (10, 40)


# ---- the divergence report -------------------------------------------------------------------------


def test_divergence_report_finds_each_split():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8], [9]]
    cand = [[1, 2, 3], [4, 9, 6], [7], [0]]
    rep = runs.divergence_report(ref, cand)
    assert rep.splits == (None, 1, 1, 0)  # r2 is a strict prefix: splits at the shorter length
    assert rep.identical == 1
    assert rep.earliest == 0
    assert rep.summary() == "1/4 identical; split r1@1 r2@1 r3@0"
    assert rep.summary(limit=1) == "1/4 identical; split r1@1 +2 more"


def test_divergence_report_all_identical():
    rep = runs.divergence_report([[5, 6], [7]], [[5, 6], [7]])
    assert rep.splits == (None, None)
    assert rep.earliest is None
    assert rep.summary() == "2/2 identical"


def test_divergence_report_refuses_different_request_counts():
    with pytest.raises(ValueError, match="2 requests but candidate has 1"):
        runs.divergence_report([[1], [2]], [[1]])


# ---- static batching helpers -----------------------------------------------------------------------


def test_static_batches_in_workload_order():
    assert hf.static_batches(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert hf.static_batches(3, 8) == [range(0, 3)]
    with pytest.raises(ValueError, match="batch_size=0"):
        hf.static_batches(3, 0)


def test_left_pad():
    ids, mask = hf.left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids == [[5, 6, 7], [0, 0, 8]]
    assert mask == [[1, 1, 1], [0, 0, 1]]


def test_step_stamped_records_place_each_request_on_its_own_last_step():
    # binary-exact stamps: arrival 8, batch start 8.5, one stamp per generation step
    stamps = [9.0, 9.25, 9.5, 9.75]
    recs = hf.step_stamped_records(8.0, 8.5, stamps, [3, 5], [[1, 2], [3, 4, 5, 6]])
    a, b = recs
    assert (a.first_token_s, a.finished_s, a.served_s, a.prefill_s) == (9.0, 9.25, 0.75, 0.5)
    assert (b.first_token_s, b.finished_s, b.served_s, b.prefill_s) == (9.0, 9.75, 1.25, 0.5)
    assert a.ttft_s == 1.0 and a.token_ids == (1, 2) and b.prompt_len == 5
    with pytest.raises(ValueError, match="5 tokens needs 1..4 stamps"):
        hf.step_stamped_records(8.0, 8.5, stamps, [3], [[1, 2, 3, 4, 5]])


# ---- per-run metrics -------------------------------------------------------------------------------


def _rec(first, finished, n, arrival=0.0, plen=4):
    return RunRecord(prompt_len=plen, token_ids=tuple(range(n)), arrival_s=arrival, first_token_s=first,
                     finished_s=finished, served_s=finished - arrival, prefill_s=first - arrival)


def test_tpot_and_decode_rate_by_hand():
    run = SystemRun("x", (_rec(1.0, 2.0, 5), _rec(1.0, 2.0, 3), _rec(1.0, 1.0, 1)), wall_s=2.0)
    # TPOT: (2-1)/4 = 0.25 and (2-1)/2 = 0.5; the one-token request has none
    assert runs.mean_tpot_s(run) == 0.375
    # decode: 4/1 and 2/1 tokens per second
    assert runs.decode_tok_per_s(run) == 3.0
    assert runs.mean_tpot_s(SystemRun("y", (_rec(1.0, 1.0, 1),), wall_s=1.0)) is None


def test_head_of_run_times_the_first_k_from_the_first_arrival():
    # a one-slot FIFO run: every request arrives at 0 and they finish at 1, 2, 4
    run = SystemRun("nano", (_rec(0.5, 1.0, 4), _rec(1.5, 2.0, 4), _rec(3.0, 4.0, 8)), wall_s=4.0)
    head = runs.head_of_run(run, 2)
    assert head.num_requests == 2 and head.wall_s == 2.0
    assert head.throughput == 4.0  # 8 tokens in 2 s
    with pytest.raises(ValueError, match="k=4"):
        runs.head_of_run(run, 4)


def test_parse_batched_bench_keeps_only_its_jsonl_rows():
    text = "\n".join([
        "main: n_kv_max = 2048",
        '{"n_kv_max": 2048, "pp": 128, "tg": 128, "pl": 1, "t_pp": 0.25, "t_tg": 3.5, "t": 3.75, "speed": 68.5}',
        "|   128 |    128 |    1 |",
        '{"n_kv_max": 2048, "pp": 128, "tg": 128, "pl": 2, "t_pp": 0.5, "t_tg": 11.0, "t": 11.5, "speed": 44.4}',
    ])
    rows = llamacpp.parse_batched_bench(text)
    assert [r["pl"] for r in rows] == [1, 2]
    assert rows[1]["t"] == 11.5


def test_parse_batched_bench_table_reads_ik_llamacpps_markdown_rows():
    from benchmarks.peerbench.precision import parse_batched_bench_table

    # ik_llama.cpp's batched-bench prints only this table (its format string, filled in by hand)
    text = "\n".join([
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |",
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|",
        "|    64 |     32 |    1 |   1536 |    0.500 |   128.00 |    2.000 |    16.00 |    2.500 |   614.40 |",
        "|    64 |     32 |   16 |   1536 |    4.000 |   256.00 |    8.000 |    64.00 |   12.000 |   128.00 |",
        "llama_print_timings:        load time =     123.45 ms",
    ])
    rows = parse_batched_bench_table(text)
    assert rows == [{"pl": 1.0, "speed_pp": 128.0, "speed_tg": 16.0}, {"pl": 16.0, "speed_pp": 256.0, "speed_tg": 64.0}]


def test_batched_bench_row_uses_its_own_totals():
    m = Measured(workload="offline", system=LLAMA_BATCHED, concurrency=4, output_tokens=256,
                    prompt_tokens=512, wall_s=8.0, ttft_s=2.0, tpot_s=0.09375, steps=64)
    row = report.row_from(m, 700.0)
    assert row["output_tok_per_s"] == 32.0  # 4 sequences x 64 tokens / 8 s
    assert row["decode_tok_per_s"] == pytest.approx(1 / 0.09375)
    assert row["peak_rss_mib"] == 700.0
    assert row["tokens_vs_reference"] == "no token ids (synthetic prompts)"


# ---- rows: ratios, fractions, gates ----------------------------------------------------------------


def _row(workload, system, conc, tok_s, decode=None, requests=8):
    row = dict.fromkeys(report.COLUMNS, "")
    row |= {"workload": workload, "system": system, "concurrency": conc, "output_tok_per_s": tok_s,
            "decode_tok_per_s": decode if decode is not None else "", "requests": requests}
    return row


def test_add_ratios_pairs_same_workload_and_concurrency():
    rows = [
        _row("ragged", NANOSERVE, 16, 200.0, decode=20.0),
        _row("ragged", HF_STATIC, 16, 50.0, decode=8.0),
        _row("ragged", HF_STATIC, 32, 60.0),  # no nanoserve at 32: no ratio
        _row("offline", HF_STATIC, 16, 40.0),  # other workload: no ratio
    ]
    report.add_ratios(rows, {})
    assert rows[1]["nanoserve_x"] == 4.0 and rows[1]["nanoserve_decode_x"] == 2.5
    assert rows[2]["nanoserve_x"] == "" and rows[3]["nanoserve_x"] == ""
    assert rows[0]["nanoserve_x"] == ""


def test_add_ratios_puts_a_serial_peer_beside_nanoserve_on_the_same_requests():
    # nanoserve's one-slot run cut to the 2 requests the serial peer ran: 8 tokens in 2 s = 4 tok/s
    head = runs.head_of_run(SystemRun("nano", (_rec(0.5, 1.0, 4), _rec(1.5, 2.0, 4), _rec(3.0, 4.0, 8)), 4.0), 2)
    rows = [_row("ragged", NANOSERVE, 1, 100.0), _row("ragged", HF_SERIAL, 1, 2.0, decode=3.0, requests=2)]
    report.add_ratios(rows, {("ragged", 2): head})
    assert rows[1]["nanoserve_x"] == 2.0  # 4 / 2, not 100 / 2
    assert rows[1]["nanoserve_decode_x"] == 2.0  # head decode: 3/0.5 and 3/0.5 = 6 tok/s, over 3


def test_add_fractions_by_hand():
    row = _row("offline", NANOSERVE, 1, 30.0)
    row |= {"prompt_tokens": 90, "output_tokens": 30, "wall_s": 1.0, "mean_tpot_s": 0.05}
    limits = {"gemm_flop_per_s": 60e9, "copy_bytes_per_s": 16e9, "read_bytes_per_s": 32e9}
    report.add_fractions([row], limits, 100_000_000, 400_000_000)
    assert row["gemm_fraction"] == pytest.approx(0.1)  # 2 x 1e8 x 30 / 6e10
    assert row["gemm_fraction_all_tokens"] == pytest.approx(0.4)  # 120 tokens/s
    assert row["bw_fraction_decode"] == pytest.approx(0.5)  # 4e8 B x 20 steps/s / 1.6e10
    assert row["bw_fraction_decode_vs_read"] == pytest.approx(0.25)  # the same over 3.2e10


def _measured(system, conc, tokens, workload="offline"):
    recs = tuple(
        RunRecord(prompt_len=4, token_ids=tuple(t), arrival_s=0.0, first_token_s=0.5 + i, finished_s=1.0 + i,
                  served_s=1.0 + i, prefill_s=0.5 + i)
        for i, t in enumerate(tokens)
    )
    return Measured(workload=workload, system=system, concurrency=conc,
                       run=SystemRun(system, recs, wall_s=float(len(tokens)) + 1.0, slots=conc))


def test_build_rows_gates_nanoserve_and_reports_peer_divergence():
    ref = [[1, 2, 3], [4, 5, 6]]
    measured = [
        (_measured(NANOSERVE, 1, ref), 900.0),
        (_measured(NANOSERVE, 2, [[1, 2, 3], [4, 5, 7]]), 900.0),  # slot 2 says something else
        (_measured(HF_SERIAL, 1, ref), 800.0),
        (_measured(HF_STATIC, 2, [[1, 9, 3], [4, 5, 6]]), 850.0),  # padding moved request 0
    ]
    rows, failures, div = report.build_rows(measured, serial_k=2)
    assert rows[0]["tokens_vs_reference"] == f"= {HF_SERIAL} on 2/2"
    assert "MISMATCH" in rows[1]["tokens_vs_reference"] and rows[1]["identical_requests"] == ""
    assert len(failures) == 2  # slot 2 against hf-generate and against slot 1
    assert "request 1: output tokens split at position 2" in failures[0]
    assert rows[3]["identical_requests"] == 1
    assert rows[3]["tokens_vs_reference"].endswith("1/2 identical; split r0@1")
    assert div == [{"workload": "offline", "system": HF_STATIC, "concurrency": 2, "reference": "nanoserve slots=1",
                    "request": 0, "prompt_len": 4, "output_len": 3, "first_divergence": 1}]
    assert [r["peak_rss_mib"] for r in rows] == [900.0, 900.0, 800.0, 850.0]


def test_build_rows_compares_a_serial_subset_on_the_requests_it_ran():
    full = [[1, 2], [3, 4], [5, 6]]
    measured = [
        (_measured(NANOSERVE, 1, full[:2]), None),  # one slot ran the serial peers' 2 requests
        (_measured(NANOSERVE, 4, full), None),  # the reference: it holds the most requests
        (_measured(HF_SERIAL, 1, full[:2]), None),
        (_measured(LLAMA_PY, 1, [[1, 2], [3, 0]]), None),
        (_measured(HF_CB, 4, full), None),
    ]
    rows, failures, div = report.build_rows(measured, serial_k=2)
    assert failures == []
    assert rows[0]["tokens_vs_reference"] == f"= {HF_SERIAL} on 2/2; = nanoserve slots=4 on 2/2"
    assert rows[1]["tokens_vs_reference"] == f"= {HF_SERIAL} on 2/2"
    assert rows[3]["tokens_vs_reference"].endswith("1/2 identical; split r1@1")
    assert rows[4]["identical_requests"] == 3
    assert [(d["system"], d["request"], d["first_divergence"]) for d in div] == [(LLAMA_PY, 1, 1)]
    # the serial peer is put beside the one-slot run on the same 2 requests: hf-generate made 4
    # tokens in its 3 s wall, nanoserve's head made them by its last finish at 2 s: 2 / (4/3)
    assert rows[2]["nanoserve_x"] == pytest.approx(1.5, rel=1e-12)


# ---- a child's own peak memory ---------------------------------------------------------------------


def test_run_child_reads_the_childs_own_peak_rss():
    # The parent holds 1.5 GiB, as a bench process holding a model does: a plain Popen child would
    # inherit that high-water mark through exec and report it as its own (CI caught this: 2569 MiB).
    parent_ballast = bytearray(1536 * 2**20)
    code = "b = bytearray(300 * 2**20); print('ok')"  # bytearray zero-fills: 300 MiB resident
    child = launcher.run_child([sys.executable, "-c", code], timeout_s=60, result_path=None)
    assert child.error == "" and child.result.strip() == "ok"
    assert 300 <= child.peak_rss_mib < 600
    del parent_ballast


def test_run_child_kills_at_the_timeout():
    child = launcher.run_child(["sleep", "30"], timeout_s=0.5, result_path=None)
    assert child.error == "timed out" and child.seconds < 10


# ---- the whole script, quick ---------------------------------------------------------------------


@pytest.mark.weights
@pytest.mark.slow
def test_quick_run_writes_the_csv(tmp_path, default_model_dir):
    out = tmp_path / "pb"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.peerbench", "--quick", "--skip-llamacpp", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with (out / "peerbench.csv").open() as f:
        rows = list(csv.DictReader(f))
    for col in ("output_tok_per_s", "mean_ttft_s", "mean_tpot_s", "peak_rss_mib", "nanoserve_x",
                "gemm_fraction", "bw_fraction_decode", "tokens_vs_reference", "gemm_peak_gflop_per_s"):
        assert col in rows[0], col
    nano = [r for r in rows if r["system"] == NANOSERVE]
    assert {(r["workload"], r["concurrency"]) for r in nano} == {
        (w, c) for w in ("offline", "ragged") for c in ("1", "4", "8")
    }
    for r in nano:
        assert float(r["output_tok_per_s"]) > 0 and float(r["peak_rss_mib"]) > 100
        assert r["tokens_vs_reference"].startswith(f"= {HF_SERIAL} on 4/4"), r
    systems = {r["system"] for r in rows}
    assert {HF_SERIAL, HF_STATIC, HF_CB} <= systems  # cb may be a row that says why it failed
    skipped = {r["system"] for r in rows if r["error"].startswith("skipped")}
    assert skipped == set()  # --skip-llamacpp leaves them out silently
    assert (out / "peerbench_divergence.csv").is_file()


# ---- the depth axis --------------------------------------------------------------------------------


@pytest.mark.weights
def test_depth_counts_llamacpps_kv_bytes_from_the_files_header():
    from benchmarks.peerbench.depth import kv_bytes_llama
    from nanoserve.model.default import gguf_path

    # SmolLM2-135M: 30 layers, 3 K/V heads of 64; K and V a token each. f16: 2 bytes a value; q8_0:
    # 34 bytes a block of 32; q4_0: 18.
    assert kv_bytes_llama(gguf_path(), "float16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_llama(gguf_path(), "q8_0") == 2 * 30 * 3 * 2 * 34
    assert kv_bytes_llama(gguf_path(), "q4_0") == 2 * 30 * 3 * 2 * 18


@pytest.mark.weights
@pytest.mark.slow
def test_depth_child_decodes_at_a_depth_and_reports_its_cache_bytes(default_model_dir):
    from benchmarks.peerbench.depth import nanoserve_depth
    from nanoserve.model.default import gguf_path

    for shared in (False, True):
        result = nanoserve_depth(gguf_path(), "float16", shared, depth=80, tg=6, threads=2, slots=[1, 3])
        assert set(result["rates"]) == set(result["prefill"]) == {1, 3}
        assert all(rate > 0 for rate in [*result["rates"].values(), *result["prefill"].values()])
        assert result["kv_cache_dtype"] == "float16"
        assert result["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2  # as llama.cpp's f16 cache holds it
