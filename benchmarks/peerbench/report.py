"""peerbench's rows: one per system, workload and concurrency (units in the column names), with the
token gates, the ratios to nanoserve and the machine-limit fractions; the text table and the PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.peerbench.limits import bandwidth_fraction, gemm_fraction
from benchmarks.peerbench.measured import HF_SERIAL, NANOSERVE, SERIAL_SYSTEMS, SYSTEMS, Measured
from benchmarks.peerbench.runs import (
    decode_tok_per_s,
    divergence_report,
    first_records,
    head_of_run,
    mean_tpot_s,
)
from nanoserve.instruments.baseline import SystemRun, UnfairComparison, compare

COLUMNS = [
    "workload", "system", "concurrency", "requests", "prompt_tokens", "output_tokens", "wall_s",
    "output_tok_per_s", "mean_ttft_s", "ttft_includes_queue", "mean_tpot_s", "decode_tok_per_s",
    "peak_rss_mib", "nanoserve_x", "nanoserve_decode_x", "tokens_vs_reference", "identical_requests",
    "gemm_fraction", "gemm_fraction_all_tokens", "bw_fraction_decode", "bw_fraction_decode_vs_read", "steps",
    "note", "error",
]


def row_from(m: Measured, peak_rss_mib: float | None) -> dict[str, Any]:
    """One CSV row (units in the column names) from a measurement; ratios and fractions filled later."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS, "")
    row |= {"workload": m.workload, "system": m.system, "concurrency": m.concurrency, "note": m.note, "error": m.error}
    row["peak_rss_mib"] = round(peak_rss_mib, 1) if peak_rss_mib is not None else ""
    if m.steps is not None:
        row["steps"] = m.steps
    if m.extra.get("kv_cache_mib") is not None:
        row["note"] = (row["note"] + "; " if row["note"] else "") + f"KV cache {m.extra['kv_cache_mib']:.0f} MiB"
    if m.run is not None:
        run = m.run
        row |= {
            "requests": run.num_requests,
            "prompt_tokens": sum(r.prompt_len for r in run.records),
            "output_tokens": run.output_tokens,
            "wall_s": run.wall_s,
            "output_tok_per_s": run.throughput,
            "mean_ttft_s": run.mean_ttft_s,
            # a serial system is handed one request at a time, so its TTFT is its prefill alone
            "ttft_includes_queue": m.system not in SERIAL_SYSTEMS,
            "mean_tpot_s": mean_tpot_s(run) or "",
            "decode_tok_per_s": decode_tok_per_s(run) or "",
        }
    elif m.wall_s is not None and m.output_tokens is not None:
        row |= {
            "requests": m.concurrency,
            "prompt_tokens": m.prompt_tokens,
            "output_tokens": m.output_tokens,
            "wall_s": m.wall_s,
            "output_tok_per_s": m.output_tokens / m.wall_s,
            "mean_ttft_s": m.ttft_s,
            "ttft_includes_queue": False,
            "mean_tpot_s": m.tpot_s,
            "decode_tok_per_s": 1.0 / m.tpot_s if m.tpot_s else "",
            "tokens_vs_reference": "no token ids (synthetic prompts)",
        }
    return row


def add_ratios(rows: list[dict[str, Any]], nano_heads: dict[tuple[str, int], SystemRun]) -> None:
    """nanoserve_x = nanoserve output tok/s / this row's, at the same workload and concurrency.

    A serial row that ran only the first k requests is put beside nanoserve's one-slot run cut to
    those k (`head_of_run`), so both sides did the same requests. `nano_heads[(workload, k)]`.
    """
    nano = {(r["workload"], r["concurrency"]): r for r in rows if r["system"] == NANOSERVE and r["output_tok_per_s"] != ""}
    for row in rows:
        if row["system"] == NANOSERVE or row["output_tok_per_s"] in ("", 0):
            continue
        head = nano_heads.get((row["workload"], row["requests"])) if row["system"] in SERIAL_SYSTEMS else None
        if head is not None:
            row["nanoserve_x"] = head.throughput / row["output_tok_per_s"]
            d = decode_tok_per_s(head)
            if d and row["decode_tok_per_s"]:
                row["nanoserve_decode_x"] = d / row["decode_tok_per_s"]
            continue
        ref = nano.get((row["workload"], row["concurrency"]))
        if ref is not None:
            row["nanoserve_x"] = ref["output_tok_per_s"] / row["output_tok_per_s"]
            if ref["decode_tok_per_s"] and row["decode_tok_per_s"]:
                row["nanoserve_decode_x"] = ref["decode_tok_per_s"] / row["decode_tok_per_s"]


def add_fractions(rows: list[dict[str, Any]], limits: dict[str, float], num_params: int, weight_bytes: int) -> None:
    """gemm_fraction (output tokens), gemm_fraction_all_tokens (prompt + output), and the decode
    bandwidth fractions: weight bytes x (1 / mean TPOT) against the copy and the read-only rates."""
    for row in rows:
        if row["output_tok_per_s"] == "":
            continue
        row["gemm_fraction"] = gemm_fraction(num_params, row["output_tok_per_s"], limits["gemm_flop_per_s"])
        all_tok_s = (row["prompt_tokens"] + row["output_tokens"]) / row["wall_s"]
        row["gemm_fraction_all_tokens"] = gemm_fraction(num_params, all_tok_s, limits["gemm_flop_per_s"])
        if row["mean_tpot_s"]:
            steps_per_s = 1.0 / row["mean_tpot_s"]  # one decode step per output token of a row
            row["bw_fraction_decode"] = bandwidth_fraction(weight_bytes, steps_per_s, limits["copy_bytes_per_s"])
            if limits.get("read_bytes_per_s"):
                row["bw_fraction_decode_vs_read"] = bandwidth_fraction(
                    weight_bytes, steps_per_s, limits["read_bytes_per_s"]
                )


def build_rows(
    measured: list[tuple[Measured, float | None]], serial_k: int
) -> tuple[list[dict[str, Any]], list[str], list[dict[str, Any]]]:
    """Rows in run order, the token gates that failed, and one divergence row per request that split.

    Gates (failures): nanoserve at every slot count against hf-generate on the requests hf-generate
    ran, and against nanoserve's fullest run (the reference) on the requests both ran, both with
    `compare`. Reports (no gate): every other system against the reference, request by request.
    """
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    div_rows: list[dict[str, Any]] = []
    nano_ref: dict[str, SystemRun] = {}  # per workload: the nanoserve run holding the most requests
    hf_serial: dict[str, SystemRun] = {}
    nano_heads: dict[tuple[str, int], SystemRun] = {}  # the one-slot run cut to what the serial peers ran
    for m, _ in measured:
        if m.run is None:
            continue
        if m.system == NANOSERVE:
            best = nano_ref.get(m.workload)
            if best is None or m.run.num_requests > best.num_requests:
                nano_ref[m.workload] = m.run
            if m.concurrency == 1:
                k = min(serial_k, m.run.num_requests)
                nano_heads[(m.workload, k)] = head_of_run(m.run, k)
        if m.system == HF_SERIAL:
            hf_serial[m.workload] = m.run
    for m, peak in measured:
        row = row_from(m, peak)
        rows.append(row)
        if m.run is None:
            continue
        ids = [r.token_ids for r in m.run.records]
        ref = nano_ref.get(m.workload)
        if m.system == NANOSERVE:
            checks = []
            references = [(hf_serial.get(m.workload), HF_SERIAL)]
            if ref is not None and ref is not m.run:
                references.append((ref, f"nanoserve slots={ref.slots}"))
            for other, label in references:
                if other is None:
                    continue
                k = min(other.num_requests, m.run.num_requests)
                try:
                    compare(first_records(other, k), first_records(m.run, k))
                    checks.append(f"= {label} on {k}/{k}")
                except UnfairComparison as e:
                    failures.append(f"{m.workload} nanoserve slots={m.concurrency} vs {label}: {e}")
                    checks.append(f"MISMATCH vs {label}")
            row["tokens_vs_reference"] = "; ".join(checks) or "no reference ran"
            row["identical_requests"] = "" if "MISMATCH" in row["tokens_vs_reference"] else m.run.num_requests
            continue
        if m.system == HF_SERIAL:
            row["tokens_vs_reference"] = "the reference (nanoserve must equal it)"
            continue
        if ref is None or ref.num_requests < len(ids):
            row["tokens_vs_reference"] = "no nanoserve run of these requests to compare with"
            continue
        rep = divergence_report([r.token_ids for r in ref.records[: len(ids)]], ids)
        row["tokens_vs_reference"] = f"vs nanoserve (= {HF_SERIAL}): {rep.summary()}"
        row["identical_requests"] = rep.identical
        for i, split in enumerate(rep.splits):
            if split is not None:
                div_rows.append({
                    "workload": m.workload, "system": m.system, "concurrency": m.concurrency,
                    "reference": f"nanoserve slots={ref.slots}", "request": i,
                    "prompt_len": m.run.records[i].prompt_len, "output_len": m.run.records[i].output_len,
                    "first_divergence": split,
                })
    add_ratios(rows, nano_heads)
    return rows, failures, div_rows


def _fmt(v: Any, spec: str) -> str:
    if v == "" or v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return format(v, spec)


def render_table(rows: list[dict[str, Any]]) -> str:
    """A fixed-width text table of the rows, one line each; errors shown in place of numbers."""
    head = (f"{'workload':<8} {'system':<23} {'conc':>4} {'req':>4} {'out tok':>7} {'tok/s':>8} {'TTFT s':>7} "
            f"{'TPOT ms':>8} {'dec tok/s':>9} {'RSS MiB':>8} {'nano x':>7} {'GEMM%':>6} {'BW%':>5}  tokens")
    lines = [head, "-" * len(head)]
    for r in rows:
        lead = f"{r['workload']:<8} {r['system']:<23} {r['concurrency']:>4} "
        if r["error"] and r["output_tok_per_s"] == "":
            lines.append(lead + f"  not run: {r['error']}")
            continue
        tpot = r["mean_tpot_s"] * 1000 if r["mean_tpot_s"] != "" else ""
        gemm = r["gemm_fraction"] * 100 if r["gemm_fraction"] != "" else ""
        bw = r["bw_fraction_decode"] * 100 if r["bw_fraction_decode"] != "" else ""
        lines.append(
            lead + f"{_fmt(r['requests'], 'd'):>4} {_fmt(r['output_tokens'], 'd'):>7} "
            f"{_fmt(r['output_tok_per_s'], '.2f'):>8} {_fmt(r['mean_ttft_s'], '.2f'):>7} {_fmt(tpot, '.1f'):>8} "
            f"{_fmt(r['decode_tok_per_s'], '.2f'):>9} {_fmt(r['peak_rss_mib'], '.0f'):>8} "
            f"{_fmt(r['nanoserve_x'], '.2f'):>7} {_fmt(gemm, '.1f'):>6} {_fmt(bw, '.1f'):>5}  {r['tokens_vs_reference']}"
        )
    return "\n".join(lines)


def write_png(rows: list[dict[str, Any]], path: Path) -> str:
    """Output tokens/s against concurrency, one line per system, one panel per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no PNG: matplotlib is not installed (pip install matplotlib)"
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.8), squeeze=False)
    for ax, wl in zip(axes[0], workloads, strict=True):
        for system in SYSTEMS:
            pts = sorted(
                (r["concurrency"], r["output_tok_per_s"])
                for r in rows
                if r["workload"] == wl and r["system"] == system and r["output_tok_per_s"] != ""
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        ax.set_xscale("log", base=2)
        ticks = sorted({r["concurrency"] for r in rows if r["workload"] == wl and r["output_tok_per_s"] != ""})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("concurrency (slots / batch size / sequences)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{wl} workload")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"

