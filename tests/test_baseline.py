"""nanoserve.baseline in three tiers: arithmetic on records placed by hand on a ruler, the gates,
and the wiring over a real (tiny) engine and transformers' generate."""

from __future__ import annotations

import time

import pytest

from nanoserve.baseline import (
    Comparison,
    RunRecord,
    RunUnsound,
    SystemRun,
    UnfairComparison,
    check_concurrent,
    check_serial,
    compare,
    first_divergence,
    hf_generate_one,
    marginal_doublings,
    render,
    render_doublings,
    run_concurrent,
    run_serial,
)


def rec(arrival, first_token, finished, served=None, prefill=None, tokens=(1, 2, 3, 4), prompt_len=6):
    """One request on the ruler. Defaults: served the whole time (serial), prefill = ttft."""
    return RunRecord(
        prompt_len=prompt_len,
        token_ids=tuple(tokens),
        arrival_s=arrival,
        first_token_s=first_token,
        finished_s=finished,
        served_s=finished - arrival if served is None else served,
        prefill_s=first_token - arrival if prefill is None else prefill,
    )


def serial_run(n=8, step=1.0, tokens=(1, 2, 3, 4), system="hf-generate"):
    """n requests one after another, each arriving when the previous finished, each `step` long."""
    records = [rec(i * step, i * step + step / 4, (i + 1) * step, tokens=tokens) for i in range(n)]
    return SystemRun(system, tuple(records), wall_s=n * step, slots=1)


def one_slot_engine_run(n=8, tokens=(1, 2, 3, 4)):
    """Day 44's gotcha: all n arrive at 0 (offline), one slot, request i served during [i, i+1)."""
    records = [rec(0.0, i + 0.25, i + 1.0, served=1.0, prefill=0.25, tokens=tokens) for i in range(n)]
    return SystemRun("nanoserve, 1", tuple(records), wall_s=float(n), slots=1)


def two_slot_run(tokens=(1, 2, 3, 4)):
    """4 requests at 0, 2 slots: r0 r1 served [0, 4), r2 r3 served [4, 8); prefill 1 s each."""
    records = [
        rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=tokens),
        rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=tokens),
    ]
    return SystemRun("nanoserve, 2", tuple(records), wall_s=8.0, slots=2)


def full_slot_run(slots, served, wall, n=8, tokens=(1, 2)):
    """n requests at 0 through `slots` slots in waves, each served `served` s; every slot always busy."""
    records = []
    for i in range(n):
        start = (i // slots) * served
        records.append(rec(0.0, start + served / 2, start + served, served=served, prefill=served / 2, tokens=tokens))
    return SystemRun(f"nanoserve, {slots}", tuple(records), wall_s=wall, slots=slots)


def assert_identities_exact(run):
    assert run.throughput == run.batch_occupancy * run.tokens_per_slot_second
    assert run.throughput == run.system_occupancy * run.tokens_per_request_second


# ---- tier 1: arithmetic on the ruler ----------------------------------------------------------


def test_record_derived_times():
    r = rec(2.0, 3.5, 6.0, served=3.0, prefill=0.5)
    assert (r.ttft_s, r.e2e_s, r.queued_s, r.output_len) == (1.5, 4.0, 1.0, 4)


def test_two_slot_run_by_hand():
    run = two_slot_run()
    assert run.num_requests == 4
    assert run.output_tokens == 16
    assert run.throughput == 2.0  # 16 tokens / 8 s
    assert run.slot_seconds == 16.0  # 4 x 4 s
    assert run.request_seconds == 24.0  # 4 + 4 + 8 + 8
    assert run.batch_occupancy == 2.0  # 16 / 8
    assert run.system_occupancy == 3.0  # 24 / 8
    assert run.tokens_per_slot_second == 1.0  # 16 / 16
    assert run.tokens_per_request_second == 16 / 24
    assert run.queue_share == pytest.approx(1 / 3, rel=1e-15)  # 8 of 24 request-seconds queued
    assert run.mean_ttft_s == 3.0  # (1 + 1 + 5 + 5) / 4
    assert run.mean_prefill_s == 1.0
    assert_identities_exact(run)


def test_one_slot_occupancy_is_not_batch_size():
    # The bug the seed describes: eight requests handed over at once to one slot. The mean number
    # in the system is (1 + 2 + ... + 8) / 8 = 4.5, the batch is exactly 1.
    run = one_slot_engine_run()
    assert run.batch_occupancy == 1.0
    assert run.system_occupancy == 4.5
    assert run.queue_share == pytest.approx(1 - 8 / 36, rel=1e-15)  # 78%: the seed's "80%" row
    assert run.tokens_per_slot_second == 4.0
    assert run.tokens_per_request_second == 32 / 36
    assert run.throughput == 4.0
    assert_identities_exact(run)


def test_identities_on_a_ragged_hand_run():
    records = (
        rec(0.0, 0.5, 3.0, served=3.0, prefill=0.5, tokens=(1, 2, 3)),
        rec(0.25, 0.5, 1.0, served=0.75, prefill=0.25, tokens=(4,)),
        rec(0.5, 2.0, 5.0, served=4.0, prefill=1.0, tokens=(5, 6, 7, 8, 9)),
    )
    run = SystemRun("ragged", records, wall_s=5.0, slots=2)
    assert run.output_tokens == 9
    assert run.slot_seconds == 7.75
    assert run.request_seconds == 3.0 + 0.75 + 4.5
    assert run.throughput == 1.8
    assert run.batch_occupancy == 1.55
    assert run.throughput == pytest.approx(run.batch_occupancy * run.tokens_per_slot_second, rel=1e-15)
    assert run.throughput == pytest.approx(run.system_occupancy * run.tokens_per_request_second, rel=1e-15)


def test_record_validation():
    with pytest.raises(ValueError, match="stamps out of order"):
        rec(1.0, 0.5, 2.0)
    with pytest.raises(ValueError, match=r"served_s=5.0 must be > 0 and <= e2e_s=2.0"):
        rec(0.0, 1.0, 2.0, served=5.0)
    with pytest.raises(ValueError, match="served_s=0.0"):
        rec(0.0, 1.0, 2.0, served=0.0)
    with pytest.raises(ValueError, match=r"prefill_s=1.5 must be >= 0 and <= ttft_s=1.0"):
        rec(0.0, 1.0, 2.0, prefill=1.5)
    with pytest.raises(ValueError, match="at least 1 output token"):
        rec(0.0, 1.0, 2.0, tokens=())
    with pytest.raises(ValueError, match="prompt_len=0"):
        rec(0.0, 1.0, 2.0, prompt_len=0)


def test_system_run_validation():
    with pytest.raises(ValueError, match="0 records"):
        SystemRun("x", (), wall_s=1.0)
    with pytest.raises(ValueError, match="wall_s=0.0 must be > 0"):
        SystemRun("x", (rec(0.0, 1.0, 2.0),), wall_s=0.0)
    with pytest.raises(ValueError, match="slots=0"):
        SystemRun("x", (rec(0.0, 1.0, 2.0),), wall_s=2.0, slots=0)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ((1, 2, 3), (1, 2, 3), None),
        ((), (), None),
        ((1, 2, 3), (9, 2, 3), 0),
        ((1, 2, 3, 4), (1, 2, 9, 4), 2),
        ((1, 2, 3), (1, 2, 3, 4), 3),  # a strict prefix splits at its own length
        ((1, 2, 3, 4), (1, 2), 2),
        ((), (5,), 0),
    ],
)
def test_first_divergence(a, b, expected):
    assert first_divergence(a, b) == expected
    assert first_divergence(list(a), list(b)) == expected


def test_comparison_factors_by_hand():
    base = serial_run(n=4, step=2.0)  # 16 tokens in 8 s: 2 tok/s, batch 1, 2 tok per slot-second
    cand = two_slot_run()  # 16 tokens in 8 s at batch 2
    c = compare(base, cand)
    assert isinstance(c, Comparison)
    assert c.speedup == 1.0
    assert c.batch_gain == 2.0
    assert c.per_slot_gain == 0.5  # 1 tok/slot-s against 2
    assert c.speedup == c.batch_gain * c.per_slot_gain
    assert c.system_gain == 3.0
    assert c.speedup == pytest.approx(c.system_gain * c.per_request_gain, rel=1e-15)
    # baseline prefill (its ttft) 0.5 s against the engine's 1.0 s
    assert c.prefill_speedup == 0.5
    row = c.as_row()
    assert row["throughput_tok_per_s"] == 2.0 and row["batch_occupancy"] == 2.0 and row["slots"] == 2
    assert all(k in row for k in ("wall_s", "tokens_per_slot_s", "mean_prefill_s", "speedup_x"))


# ---- tier 2: the gates -------------------------------------------------------------------------


def test_compare_refuses_different_request_counts():
    with pytest.raises(UnfairComparison, match="ran 8 requests but 'nanoserve, 2' ran 4"):
        compare(serial_run(n=8), two_slot_run())


def test_compare_refuses_different_prompt_lengths():
    cand = two_slot_run()
    records = list(cand.records)
    records[2] = rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, prompt_len=7)
    with pytest.raises(UnfairComparison, match="request 2: prompt length 6 in 'hf-generate' but 7"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_compare_refuses_different_output_lengths():
    cand = two_slot_run()
    records = list(cand.records)
    records[1] = rec(0.0, 1.0, 4.0, served=4.0, prefill=1.0, tokens=(1, 2, 3))
    with pytest.raises(UnfairComparison, match="request 1: output length 4 in 'hf-generate' but 3"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_compare_refuses_different_output_tokens_and_says_where():
    cand = two_slot_run()
    records = list(cand.records)
    records[3] = rec(0.0, 5.0, 8.0, served=4.0, prefill=1.0, tokens=(1, 2, 9, 4))
    with pytest.raises(UnfairComparison, match=r"request 3: output tokens split at position 2 \(3 in 'hf-generate', 9 in 'c'\)"):
        compare(serial_run(n=4), SystemRun("c", tuple(records), 8.0, 2))


def test_unfair_and_unsound_are_value_errors():
    assert issubclass(UnfairComparison, ValueError) and issubclass(RunUnsound, ValueError)


def test_check_serial_passes_a_serial_run():
    run = serial_run()
    assert check_serial(run) is run


def test_check_serial_refuses_overlap():
    records = (rec(0.0, 0.5, 2.0), rec(1.0, 1.5, 3.0))
    with pytest.raises(RunUnsound, match="arrived at 1.000000 before the previous one finished at 2.000000"):
        check_serial(SystemRun("s", records, wall_s=3.0))


def test_check_serial_refuses_occupancy_far_from_one():
    records = serial_run(n=4).records  # 4 s of generation
    with pytest.raises(RunUnsound, match=r"batch occupancy 0.5000 is outside 1 \+/- 0.05"):
        check_serial(SystemRun("s", records, wall_s=8.0))
    assert check_serial(SystemRun("s", records, wall_s=4.1)).wall_s == 4.1  # 0.976: within 5%


def test_check_serial_refuses_records_outside_the_wall_clock():
    with pytest.raises(RunUnsound, match="records span 8.000000s but wall_s is 4.000000s"):
        check_serial(SystemRun("s", serial_run().records, wall_s=4.0))


def test_check_concurrent_passes_a_batched_run():
    run = two_slot_run()
    assert check_concurrent(run) is run
    assert check_concurrent(one_slot_engine_run()).slots == 1  # one slot, batch 1: what it claims


def test_check_concurrent_gates_on_batch_not_system_occupancy():
    # The serial-shaped offline run relabelled as four slots. System occupancy is 4.5, which a gate
    # reading it would wave through; batch occupancy is 1.0, so it did not batch.
    run = one_slot_engine_run()
    relabelled = SystemRun("nanoserve, 4", run.records, run.wall_s, slots=4)
    assert relabelled.system_occupancy > 4
    with pytest.raises(RunUnsound, match=r"batch occupancy 1.0000 <= 1.05 with 4 slots and 8 requests"):
        check_concurrent(relabelled)


def test_check_concurrent_refuses_more_rows_than_slots():
    run = two_slot_run()
    with pytest.raises(RunUnsound, match="batch occupancy 2.0000 exceeds 1 slots"):
        check_concurrent(SystemRun("x", run.records, run.wall_s, slots=1))


def test_check_concurrent_allows_one_request_at_many_slots():
    run = SystemRun("x", (rec(0.0, 0.5, 2.0),), wall_s=2.0, slots=4)
    assert check_concurrent(run) is run


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


# ---- tier 3: the runners -----------------------------------------------------------------------


def sleepy_generator(stamp_clock=time.perf_counter):
    """A one-at-a-time generator: 5 ms of 'prefill', 5 ms of 'decode', tokens = prompt reversed."""

    def generate_one(prompt_ids, max_new_tokens):
        time.sleep(0.005)
        first = stamp_clock()
        time.sleep(0.005)
        return (prompt_ids[::-1] * max_new_tokens)[:max_new_tokens], first, "ignored extra"

    return generate_one


def test_run_serial_records_prefill_as_ttft():
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    run = run_serial(sleepy_generator(), prompts, max_new_tokens=[2, 3, 4])
    assert run.system == "hf-generate" and run.slots == 1
    assert [r.prompt_len for r in run.records] == [3, 2, 4]
    assert [r.token_ids for r in run.records] == [(3, 2), (5, 4, 5), (9, 8, 7, 6)]
    for r in run.records:
        assert r.prefill_s == r.ttft_s  # deliberately: no queue, so the wait is the prompt forward
        assert r.served_s == r.e2e_s
        assert r.ttft_s >= 0.005
    check_serial(run)
    assert run.throughput == pytest.approx(run.batch_occupancy * run.tokens_per_slot_second, rel=1e-12)


def test_run_serial_refuses_a_stamp_from_another_clock():
    with pytest.raises(RunUnsound, match="outside its call"):
        run_serial(sleepy_generator(stamp_clock=time.time), [[1, 2]], 2)


def test_run_serial_rejects_bad_lengths():
    with pytest.raises(ValueError, match="2 output lengths for 1 prompts"):
        run_serial(sleepy_generator(), [[1]], [2, 3])
    with pytest.raises(ValueError, match=r"max_new_tokens\[0\]=0"):
        run_serial(sleepy_generator(), [[1]], 0)


PROMPTS = [[5, 17, 30], [8, 9, 60, 61, 62], [40, 41], [70, 3, 12, 90]]


def test_run_concurrent_reads_the_engines_own_stamps(tiny_engine):
    engine = tiny_engine(max_num_seqs=4)
    seen = {}
    step = engine.step

    def spy_step():
        outs = step()
        seen.update({o.request_id: o for o in outs if o.finished})
        return outs

    engine.step = spy_step
    run = run_concurrent(engine, PROMPTS, max_new_tokens=6)
    assert run.system == "nanoserve, 4" and run.slots == 4
    finals = sorted(seen.values(), key=lambda o: int(o.request_id))
    for r, o in zip(run.records, finals, strict=True):
        assert r.arrival_s == o.arrival_time
        assert r.first_token_s == o.first_token_time
        assert r.finished_s == o.finished_time
        assert r.served_s == o.running_s
        assert r.prefill_s == o.first_token_time - o.first_scheduled_time
        assert r.token_ids == tuple(o.token_ids) and r.output_len == 6
    assert [r.prompt_len for r in run.records] == [3, 5, 2, 4]
    check_concurrent(run)
    assert run.batch_occupancy > 1.05
    # the identities on a real run, to float rounding
    assert run.throughput == pytest.approx(run.batch_occupancy * run.tokens_per_slot_second, rel=1e-12)
    assert run.throughput == pytest.approx(run.system_occupancy * run.tokens_per_request_second, rel=1e-12)


def test_one_slot_real_run_queues_but_does_not_batch(tiny_engine):
    run = run_concurrent(tiny_engine(max_num_seqs=1), PROMPTS, max_new_tokens=4)
    check_concurrent(run)
    assert run.batch_occupancy <= 1.0  # served intervals are disjoint and inside the wall clock
    # four requests handed over at once: about (1 + 2 + 3 + 4) / 4 = 2.5 in the system
    assert run.system_occupancy > 1.5
    with pytest.raises(RunUnsound, match="fell back to one row at a time"):
        check_concurrent(SystemRun("claims 4", run.records, run.wall_s, slots=4))


def test_run_concurrent_refuses_a_busy_engine(tiny_engine):
    from nanoserve import SamplingParams

    engine = tiny_engine()
    engine.add_request([1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="unfinished requests"):
        run_concurrent(engine, PROMPTS, 2)


def test_hf_generate_one_stamps_without_changing_tokens():
    import torch
    from conftest import make_hf_llama

    hf = make_hf_llama(0)
    prompt = [5, 17, 30, 4]
    plain = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                        max_new_tokens=7, do_sample=False, eos_token_id=None, pad_token_id=0)
    generate_one = hf_generate_one(hf)
    before = time.perf_counter()
    tokens, first = generate_one(prompt, 7)
    after = time.perf_counter()
    assert tokens == plain[0, 4:].tolist()
    assert len(tokens) == 7
    assert before < first < after


def test_hf_generate_one_runs_past_eos():
    from conftest import make_hf_llama

    hf = make_hf_llama(0)
    generate_one = hf_generate_one(hf)
    tokens, _ = generate_one([5, 17, 30, 4], 7)
    hf.generation_config.eos_token_id = tokens[1]  # would stop generate at the second token
    again, _ = hf_generate_one(hf)([5, 17, 30, 4], 7)
    assert again == tokens


def test_engine_and_hf_agree_token_for_token(tiny_engine):
    # The same tiny random Llama on both sides (conftest builds the engine from the HF weights),
    # greedy on both: compare must accept it, and the speedup splits into its two factors.
    from conftest import make_hf_llama

    base = check_serial(run_serial(hf_generate_one(make_hf_llama(0)), PROMPTS, 6))
    cand = check_concurrent(run_concurrent(tiny_engine(0, max_num_seqs=4), PROMPTS, 6))
    c = compare(base, cand)
    assert c.speedup == pytest.approx(c.batch_gain * c.per_slot_gain, rel=1e-12)
    assert "nanoserve, 4" in render([c])
    # a different model says something else, and compare refuses it
    other = run_concurrent(tiny_engine(1, max_num_seqs=4), PROMPTS, 6)
    with pytest.raises(UnfairComparison, match="output tokens split at position"):
        compare(base, other)


@pytest.mark.weights
@pytest.mark.slow
def test_default_model_agrees_with_hf_generate(hf_default, default_model_dir):
    from nanoserve import Engine, EngineConfig

    model, tokenizer = hf_default
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    base = check_serial(run_serial(hf_generate_one(model), prompts, 6))
    engine = Engine.from_pretrained(default_model_dir, EngineConfig(max_num_seqs=4, max_model_len=256))
    cand = check_concurrent(run_concurrent(engine, prompts, 6))
    c = compare(base, cand)  # refuses unless every token id agrees
    assert c.candidate.output_tokens == 18
