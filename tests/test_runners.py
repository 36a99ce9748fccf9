"""nanoserve.instruments.runners: the serial runner over a generator that sleeps, the engine's own
concurrent run, and transformers' generate with its first token stamped; a real (tiny) engine and
transformers agree token for token."""

from __future__ import annotations

import time

import pytest

from nanoserve.instruments.baseline import (
    RunUnsound,
    SystemRun,
    UnfairComparison,
    check_concurrent,
    check_serial,
    compare,
)
from nanoserve.instruments.runners import hf_generate_one, run_concurrent, run_serial
from nanoserve.instruments.sweep import render


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
        assert r.request_id == o.request_id and r.first_scheduled_s == o.first_scheduled_time
        assert r.token_times == tuple(o.token_times) and r.tpot_s == (r.e2e_s - r.ttft_s) / 5
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
    engine = Engine.from_pretrained(default_model_dir, EngineConfig(dtype="float32", quantization=None, max_num_seqs=4, max_model_len=256))
    cand = check_concurrent(run_concurrent(engine, prompts, 6))
    c = compare(base, cand)  # refuses unless every token id agrees
    assert c.candidate.output_tokens == 18


def test_decode_rate_times_decode_steps_and_leaves_the_engine_empty():
    from conftest import make_tiny_engine

    from nanoserve.instruments.runners import decode_rate

    engine = make_tiny_engine(max_num_seqs=3, num_kv_blocks=64)
    steps_before = engine.num_steps
    rate = decode_rate(engine, slots=3, steps=4, prompt_len=6)
    assert rate > 0 and not engine.has_unfinished()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    # 3 prompts of 6 tokens fit one step's budget: 1 prefill, 1 uncounted decode, 4 timed, then the
    # last of max_tokens = steps + 2 = 6 tokens (the prefill samples the first).
    assert engine.num_steps - steps_before == 1 + 1 + 4
