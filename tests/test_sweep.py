"""nanoserve.instruments.sweep: the comparison table and a slot sweep's doublings, on runs placed by
hand on a ruler."""

from __future__ import annotations

import pytest
from test_baseline import full_slot_run, serial_run, two_slot_run

from nanoserve.instruments.baseline import UnfairComparison, compare
from nanoserve.instruments.sweep import marginal_doublings, render, render_doublings


def test_marginal_doublings_by_hand():
    # 8 requests of 2 tokens (16 tokens). Throughput: 16/8, 16/6, 16/5, 16/6.
    runs = [
        full_slot_run(1, served=1.0, wall=8.0),
        full_slot_run(2, served=1.5, wall=6.0),
        full_slot_run(4, served=2.5, wall=5.0),
        full_slot_run(8, served=6.0, wall=6.0),
    ]
    d = marginal_doublings(runs)
    assert [(x.from_slots, x.to_slots) for x in d] == [(1, 2), (2, 4), (4, 8)]
    assert [x.batch_ratio for x in d] == [2.0, 2.0, 2.0]
    # tokens per slot-second: 16/8, 16/12, 16/20, 16/48
    expected_per_slot = [(16 / 12) / 2, (16 / 20) / (16 / 12), (16 / 48) / (16 / 20)]
    expected_throughput = [(16 / 6) / 2, (16 / 5) / (16 / 6), (16 / 6) / (16 / 5)]
    for x, ps, tp in zip(d, expected_per_slot, expected_throughput, strict=True):
        assert x.per_slot_ratio == pytest.approx(ps, rel=1e-12)
        assert x.throughput_ratio == pytest.approx(tp, rel=1e-12)
        assert x.throughput_ratio == pytest.approx(x.batch_ratio * x.per_slot_ratio, rel=1e-12)
    assert [x.verdict for x in d] == ["worth it", "worth it", "not worth it"]
    table = render_doublings(d)
    assert "-> 8" in table and "0.42" in table and "0.83" in table and "not worth it" in table


def test_marginal_doublings_refuses_bad_sweeps():
    with pytest.raises(ValueError, match="at least 2 runs"):
        marginal_doublings([two_slot_run()])
    with pytest.raises(ValueError, match="slots go 1 -> 4"):
        marginal_doublings([full_slot_run(1, 1.0, 8.0), full_slot_run(4, 2.5, 5.0)])
    other = full_slot_run(2, 1.5, 6.0, tokens=(1, 3))
    with pytest.raises(UnfairComparison, match="split at position 1"):
        marginal_doublings([full_slot_run(1, 1.0, 8.0), other])


def test_render_table_by_hand():
    base = serial_run(n=4, step=2.0)
    table = render([compare(base, two_slot_run())])
    lines = table.splitlines()
    assert len(lines) == 3
    assert lines[0].split()[:3] == ["system", "tok/s", "speedup"]
    # baseline: 2.00 tok/s, 1.00x, batch 1.00, 1.00x, 0% queue, 1.00x
    assert lines[1].split() == ["hf-generate", "2.00", "1.00x", "1.00", "1.00x", "0%", "1.00x"]
    # candidate: 2.00 tok/s, 1.00x, batch 2.00, per slot 0.50x, queue 33%, prefill 0.50x
    assert lines[2].split() == ["nanoserve,", "2", "2.00", "1.00x", "2.00", "0.50x", "33%", "0.50x"]
    with pytest.raises(ValueError, match="same baseline"):
        render([compare(base, two_slot_run()), compare(serial_run(n=4, step=2.0), two_slot_run())])
    with pytest.raises(ValueError, match="at least 1 comparison"):
        render([])
