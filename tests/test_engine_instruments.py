"""The instruments wired into the real engine loop: the six recorded phases and the one readback.

Every test runs on the tiny random Llama of conftest, so the whole file takes a few seconds.
Expected counts come from the schedule worked by hand in each test's comment; the readback tests
turn every route by which a tensor's value reaches Python into an exception (or a counter) around
the real Engine._sample and Engine._collect, so "did not read back" is something that can fail.
"""

from __future__ import annotations

import pytest
from conftest import READBACK_ROUTES, ReadbackHappened, make_tiny_engine, readbacks_counted

from nanoserve import Engine, SamplingParams
from nanoserve.output import (
    TokenBatch,
    check_device_resident,
    check_in_row_order,
    check_single_transfer,
)
from nanoserve.profiler import (
    NULL_RECORDER,
    OVERLAPPED,
    PHASES,
    SERIAL,
    NotDeviceTimed,
    StepProfile,
    StepRecorder,
    StepSample,
    check_accounted,
    check_device_timed,
    check_warmed_up,
    recommended_model,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
TOP_P = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=3, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, top_k=5, seed=1234, max_tokens=3, ignore_eos=True)

PROMPT_A = [5, 6, 7]  # 3 tokens
PROMPT_B = [8, 9, 10, 11, 12]  # 5 tokens


def _engine(recorder):
    engine = make_tiny_engine()
    engine.recorder = recorder
    return engine


def _two_prompt_run(recorder) -> tuple[Engine, list[list[int]]]:
    """PROMPT_A and PROMPT_B, greedy, 3 tokens each: one prefill step then two decode steps."""
    engine = _engine(recorder)
    engine.add_request(PROMPT_A, GREEDY, request_id="a")
    engine.add_request(PROMPT_B, GREEDY, request_id="b")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    return engine, [tokens["a"], tokens["b"]]


# --------------------------------------------------------------------------------------------
# The recorder inside Engine.step
# --------------------------------------------------------------------------------------------


def test_each_step_records_the_six_phases_in_order_with_the_hand_schedule():
    recorder = StepRecorder()
    engine, tokens = _two_prompt_run(recorder)
    # Step 1 forwards both prompts whole (3 + 5 = 8 tokens) and samples one token for each:
    # 2 rows, neither a decode. Steps 2 and 3 forward one token per request: 2 tokens, 2 decode rows.
    # Three steps in all; each request then has its 3 tokens and finishes in step 3.
    assert [(s.num_tokens, s.num_rows, s.num_decode_rows) for s in recorder.samples] == [
        (8, 2, 0),
        (2, 2, 2),
        (2, 2, 2),
    ]
    assert engine.num_steps == 3
    assert [len(t) for t in tokens] == [3, 3]
    for sample in recorder.samples:
        assert tuple(p.name for p in sample.phases) == PHASES
        # The readback is in collect, not in sample: collect is the one syncing phase.
        assert [p.name for p in sample.phases if p.syncs] == ["collect"]
        assert all(p.device_s is None for p in sample.phases)  # a CPU has no second clock
        assert 0.0 < sample.accounted_s <= sample.host_s


def test_an_empty_step_records_only_the_schedule_and_no_rows():
    recorder = StepRecorder()
    engine = _engine(recorder)
    assert engine.step() == []
    (sample,) = recorder.samples
    assert tuple(p.name for p in sample.phases) == ("schedule",)
    assert (sample.num_tokens, sample.num_rows, sample.num_decode_rows) == (0, 0, 0)
    assert engine.num_steps == 0


def test_a_real_engine_profile_passes_the_gates_a_cpu_can_pass_and_is_serial():
    recorder = StepRecorder()
    # Eight layers through decoder_layer, not two, nor the one C call: the recorder's own cost is a
    # fixed 10-30 us a step, which crossed check_accounted's 2% on short steps (a two-layer step of
    # 1.5 ms one run in three; 128 layers in one fused call, 1.1 ms, came to 1.4-1.6%); a real step
    # is far longer than either.
    engine = make_tiny_engine(hf_overrides={"num_hidden_layers": 8}, fused_decode=False)
    engine.recorder = recorder
    # 2 prompts x 12 tokens: 1 prefill step + 11 decode steps, all with 2 rows.
    engine.generate([PROMPT_A, PROMPT_B], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert len(recorder.samples) == 12
    profile = recorder.profile(warmup=2, decode_only=True)
    assert profile.num_steps == 10  # 12 recorded, 2 dropped as warm-up (the prefill among them)
    assert profile.mean_rows == 2.0
    check_warmed_up(profile, 2)
    # The default 2% tolerance: the gap is the recorder's own cost, tens of microseconds a step.
    check_accounted(profile)
    assert recommended_model(profile) == SERIAL
    assert profile.sync_points == 1
    with pytest.raises(NotDeviceTimed):
        check_device_timed(profile)


def test_check_accounted_refuses_the_same_profile_with_a_phase_removed():
    recorder = StepRecorder()
    engine = _engine(recorder)
    engine.generate([PROMPT_A, PROMPT_B], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    profile = recorder.profile(warmup=1)
    stripped = StepProfile(
        tuple(
            StepSample(tuple(p for p in s.phases if p.name != "forward"), s.num_rows, s.num_tokens,
                    s.num_decode_rows, s.host_s)
            for s in profile.samples
        ),
        warmup=1,
    )
    with pytest.raises(ValueError, match="phases cover"):
        check_accounted(stripped)


# --------------------------------------------------------------------------------------------
# The readback: none in sample, exactly one in collect
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["step_recorder", "null_recorder"])
def recorder(request):
    return StepRecorder() if request.param == "step_recorder" else NULL_RECORDER


def _instrumented(engine):
    """Wraps the engine's _sample and _collect: sample under no readback at all, collect counted.

    Returns a log of (batch, row owners as the scheduler handed them, readback counts in collect,
    journeys the engine's Readback counted during collect) per step.
    """
    log: list[dict] = []
    sample, collect = engine._sample, engine._collect

    def guarded_sample(logits, rows, *rest):
        with readbacks_counted(forbid=READBACK_ROUTES):
            batch = sample(logits, rows, *rest)
        log.append({"batch": batch, "owners": rows.request_ids})
        return batch

    def counted_collect(sched, sampled):
        journeys = engine.output.readback.journeys
        with readbacks_counted(forbid=tuple(r for r in READBACK_ROUTES if r != "tolist")) as counts:
            outputs = collect(sched, sampled)
        log[-1]["tolist_calls"] = counts["tolist"]
        log[-1]["journeys"] = engine.output.readback.journeys - journeys
        return outputs

    engine._sample = guarded_sample
    engine._collect = counted_collect
    return log


@pytest.mark.parametrize(
    "params",
    [[GREEDY] * 3, [TOP_P] * 3, [GREEDY, TOP_P, SEEDED]],
    ids=["all-greedy", "all-top-p", "greedy+top-p+seeded"],
)
def test_sample_reads_nothing_back_and_collect_reads_back_once_per_step(recorder, params):
    engine = _engine(recorder)
    log = _instrumented(engine)
    prompts = [PROMPT_A, PROMPT_B, [20, 21, 22, 23]]
    outs = engine.generate(prompts, params)
    # All three prompts fit one step (3 + 5 + 4 tokens), then two decode steps: 3 steps, 3 rows each.
    assert [len(o.token_ids) for o in outs] == [3, 3, 3]
    assert len(log) == 3
    for entry in log:
        assert isinstance(entry["batch"], TokenBatch)
        assert entry["tolist_calls"] == 1  # one .tolist(), nothing else reached Python
        assert entry["journeys"] == 1  # and the engine's Readback counted exactly that journey
    assert engine.output.readback.journeys == 3
    assert engine.output.readback.elements == 9  # 3 steps x 3 rows
    assert engine.output.num_steps == 3
    assert engine.output.transfers_per_step == 1.0
    check_single_transfer(engine.output)


def test_the_guard_around_sample_would_catch_a_readback(recorder):
    # The same wrapper, over a _sample that reads its tokens home row by row.
    engine = _engine(recorder)
    original = engine._sample

    def reads_back(logits, rows, *rest):
        batch = original(logits, rows, *rest)
        [int(t) for t in batch.tokens]  # one int(tensor) per row
        return batch

    engine._sample = reads_back
    _instrumented(engine)
    with pytest.raises(ReadbackHappened, match="__int__|__index__|item"):
        engine.generate([PROMPT_A], TOP_P)


def test_sampled_tokens_stay_on_the_device_in_row_order(recorder):
    engine = _engine(recorder)
    log = _instrumented(engine)
    engine.add_request(PROMPT_A, GREEDY, request_id="a")
    engine.add_request(PROMPT_B, TOP_P, request_id="b")
    engine.step()
    # The first step: both prompts, in the order they were added.
    assert log[0]["owners"] == ("a", "b")
    engine.add_request([30, 31], SEEDED, request_id="c")
    while engine.has_unfinished():
        engine.step()
    # Step 2: the decodes of a and b come first, then c's prompt; step 3 decodes all three.
    # a and b finish in step 3 (3 tokens each), c needs one more decode in step 4.
    assert [entry["owners"] for entry in log] == [("a", "b"), ("a", "b", "c"), ("a", "b", "c"), ("c",)]
    for entry in log:
        batch = entry["batch"]
        check_in_row_order(batch, entry["owners"])
        check_device_resident(batch.tokens, engine.device)
        assert batch.resolved  # collect resolved it, once


def test_the_engine_output_after_generate_reads_one_transfer_per_step(recorder):
    engine = _engine(recorder)
    engine.generate([PROMPT_A, PROMPT_B], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    # 1 prefill step + 4 decode steps, one journey each.
    assert engine.num_steps == 5
    assert engine.output.num_steps == 5
    assert engine.output.readback.journeys == 5
    assert engine.output.transfers_per_step == 1.0
    check_single_transfer(engine.output)


def test_null_recorder_and_step_recorder_produce_identical_tokens():
    params = [GREEDY, TOP_P, SEEDED]
    prompts = [PROMPT_A, PROMPT_B, [20, 21, 22, 23]]
    with_recorder = _engine(StepRecorder()).generate(prompts, params)
    without = _engine(NULL_RECORDER).generate(prompts, params)
    assert [o.token_ids for o in with_recorder] == [o.token_ids for o in without]
    assert NULL_RECORDER.samples == ()  # the null recorder kept nothing


def test_null_recorder_matches_the_hand_schedule_tokens():
    _, recorded = _two_prompt_run(StepRecorder())
    _, unrecorded = _two_prompt_run(NULL_RECORDER)
    assert recorded == unrecorded


# --------------------------------------------------------------------------------------------
# Deferred output: the same readback, off the critical path
# --------------------------------------------------------------------------------------------


def test_deferred_output_takes_the_sync_off_collect_and_keeps_one_journey_per_step():
    recorder = StepRecorder()
    engine = make_tiny_engine(deferred_output=True)
    engine.recorder = recorder
    log = _instrumented(engine)
    engine.add_request(PROMPT_A, GREEDY, request_id="a")
    engine.add_request(PROMPT_B, GREEDY, request_id="b")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] = out.token_ids
    # By hand: step 1 prefills both and resolves nothing (nothing in flight); steps 2 and 3 decode
    # both and resolve the step before; after step 3 each has 2 tokens home and its 3rd pending,
    # so it is length-capped and step 4 schedules nothing and only flushes step 3's tokens.
    assert [(s.num_tokens, s.num_rows, s.num_decode_rows) for s in recorder.samples] == [
        (8, 2, 0),
        (2, 2, 2),
        (2, 2, 2),
        (0, 0, 0),
    ]
    assert [entry["journeys"] for entry in log] == [0, 1, 1]  # collect's readbacks, steps 1 to 3
    assert engine.output.readback.journeys == 3  # the third is the flush in step 4
    assert engine.output.transfers_per_step == 1.0
    check_single_transfer(engine.output)
    for sample in recorder.samples[:3]:
        assert tuple(p.name for p in sample.phases) == PHASES
        assert not any(p.syncs for p in sample.phases)  # collect no longer waits on this step
    profile = recorder.profile(warmup=1)
    assert profile.sync_points == 0
    assert recommended_model(profile) == OVERLAPPED
    # and the tokens are the synchronous loop's
    assert [tokens["a"], tokens["b"]] == _two_prompt_run(NULL_RECORDER)[1]
