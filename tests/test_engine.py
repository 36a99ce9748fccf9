"""Engine over a tiny random Llama: bad input, finish reasons, aborts, stats, order, timestamps,
preemption.

Token ids are never hard-coded from a run of the code under test: every comparison is between
two runs that must agree (a request with and without company, with and without an abort or a
preemption), and block counts and queue lengths are worked out by hand from the config.
"""

from __future__ import annotations

import pytest
import torch
from conftest import CharTokenizer, greedy, make_tiny_engine
from test_request import BAD_PROMPTS, EXPECTED

from nanoserve import Engine, EngineConfig, SamplingParams

PROMPT = [5, 9, 13, 22, 7, 41]
GREEDY8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)




def solo(prompt, params: SamplingParams, seed: int = 0) -> list[int]:
    """The tokens a prompt produces alone in a fresh engine with a big pool."""
    return make_tiny_engine(seed, num_kv_blocks=256).generate([prompt], params)[0].token_ids


def run_to_end(engine: Engine, max_steps: int = 200) -> dict:
    """Steps until nothing is left; returns each request's last output."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return final
        for out in engine.step():
            final[out.request_id] = out
        engine.check_invariants()
    raise AssertionError(f"still unfinished after {max_steps} steps")


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return solo(PROMPT, GREEDY8)


# ---- bad input ---------------------------------------------------------------------------------

BAD_INPUTS = {
    "empty str": (lambda e: e.add_request("", GREEDY8), "prompt is empty: it needs at least 1 token"),
    "empty list": (lambda e: e.add_request([], GREEDY8), "prompt is empty: it needs at least 1 token"),
    "over max_model_len": (lambda e: e.add_request([5] * 30, SamplingParams(max_tokens=3)),
                           r"prompt \(30 tokens\) \+ max_tokens \(3\) = 33 exceeds max_model_len=32"),
    # 20 + 5 = 25 tokens need ceil(25 / 4) = 7 blocks; the pool has 6.
    "over the pool": (lambda e: e.add_request([5] * 20, SamplingParams(max_tokens=5)),
                      "request needs 7 KV blocks at full length, the whole pool has 6"),
    "negative token": (lambda e: e.add_request([5, -1, 6], GREEDY8), r"token id -1 is outside the vocabulary \[0, 97\)"),
    "token = vocab": (lambda e: e.add_request([5, 97], GREEDY8), r"token id 97 is outside the vocabulary \[0, 97\)"),
    "abort unknown": (lambda e: e.abort("nope"), "request_id 'nope' is not an unfinished request"),
    "duplicate id": (lambda e: e.add_request([5, 6], GREEDY8, request_id="live"), "request_id 'live' is already in use"),
}
# Prompts of a type that is neither text nor token ids (tests/test_request.py has the whole catalogue).
WRONG_TYPES = ["dict", "BatchEncoding", "floats", "nested lists", "None", "bytes", "a bool"]
BAD_INPUTS |= {f"prompt: {name}": (lambda e, prompt=BAD_PROMPTS[name][0]: e.add_request(prompt, GREEDY8),
                                   EXPECTED + BAD_PROMPTS[name][1]) for name in WRONG_TYPES}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_input_raises_and_the_engine_keeps_serving(name, reference):
    bad, message = BAD_INPUTS[name]
    engine = make_tiny_engine(max_model_len=32, num_kv_blocks=6)
    engine.add_request(PROMPT, GREEDY8, request_id="live")
    engine.step()
    engine.step()
    before = engine.stats()
    with pytest.raises(ValueError, match=message):
        bad(engine)
    assert engine.stats() == before  # nothing half-added
    engine.check_invariants()
    final = run_to_end(engine)
    assert list(final) == ["live"]
    assert final["live"].token_ids == reference
    assert final["live"].finish_reason == "length"


def test_max_model_len_beyond_the_model_positions_is_refused():
    # The tiny model has max_position_embeddings=256.
    with pytest.raises(ValueError, match="max_model_len=257 exceeds the model's 256 positions"):
        make_tiny_engine(max_model_len=257)
    assert make_tiny_engine(max_model_len=256).max_model_len == 256


def test_a_budget_below_max_model_len_without_chunked_prefill_is_refused():
    # max_model_len=None resolves to the model's 256 positions; a 10-token prompt with a budget of 8
    # could never be scheduled without chunking, so the engine refuses the configuration itself.
    with pytest.raises(ValueError, match="max_num_batched_tokens=8 is below max_model_len=256"):
        make_tiny_engine(enable_chunked_prefill=False, max_num_batched_tokens=8)
    engine = make_tiny_engine(enable_chunked_prefill=False, max_num_batched_tokens=256)
    engine.add_request([5] * 10, SamplingParams(max_tokens=2))
    for _ in range(3):
        engine.step()
    assert not engine.has_unfinished()


def test_automatic_ids_never_collide_with_caller_ids():
    engine = make_tiny_engine()
    engine.add_request(PROMPT, GREEDY8, request_id="0")
    rid = engine.add_request(PROMPT, GREEDY8)
    assert rid != "0"


def test_a_generate_call_refused_for_bad_input_leaves_nothing_behind():
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.generate([PROMPT, []], GREEDY8)
    assert not engine.has_unfinished()
    assert engine.stats().num_waiting == 0


@pytest.mark.parametrize("name", WRONG_TYPES)
def test_generate_refuses_a_prompt_of_another_type_and_leaves_nothing_behind(name):
    prompt, names = BAD_PROMPTS[name]
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match=EXPECTED + names):
        engine.generate([PROMPT, prompt], GREEDY8)
    assert not engine.has_unfinished() and engine.stats().num_waiting == 0


def test_generate_takes_a_single_str_as_one_prompt():
    outs = make_tiny_engine().generate("hello", greedy(3))
    assert len(outs) == 1 and outs[0].prompt_token_ids == [3 + ord(c) % 94 for c in "hello"]


# ---- finish reasons ----------------------------------------------------------------------------


def test_length_finish_at_max_tokens(reference):
    engine = make_tiny_engine()
    outs = engine.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), GREEDY8])
    assert [o.token_ids for o in outs] == [reference[:1], reference]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert all(o.finished for o in outs)


def test_stop_token_ids_stop_after_that_token(reference):
    first = reference[0]
    engine = make_tiny_engine()
    out = engine.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[first]))[0]
    assert out.token_ids == [first]
    assert out.finish_reason == "stop"
    # A later stop: the first token that did not appear before it.
    k = next(i for i in range(1, len(reference)) if reference[i] not in reference[:i])
    out = make_tiny_engine().generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                               stop_token_ids=(reference[k], 96)))[0]
    assert out.token_ids == reference[: k + 1]
    assert out.finish_reason == "stop"


class EosTokenizer(CharTokenizer):
    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        super().__init__(vocab_size)
        self.eos_token_id = eos_token_id


def test_eos_stops_unless_ignore_eos(reference):
    # Random weights never make EOS likely, so make the token greedy produces first an EOS.
    base = make_tiny_engine()
    engine = Engine(base.model, EosTokenizer(97, reference[0]), base.config)
    assert reference[0] in engine.eos_token_ids
    stopped, ignored = engine.generate([PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=8), GREEDY8])
    assert stopped.token_ids == reference[:1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == reference and ignored.finish_reason == "length"


# ---- abort ---------------------------------------------------------------------------------------

PROMPTS = [PROMPT, [17, 4, 8], [30 + i for i in range(10)]]


def test_abort_returns_blocks_and_leaves_the_others_unchanged():
    expected = make_tiny_engine().generate(PROMPTS, GREEDY8)
    engine = make_tiny_engine()  # 64 blocks of 4
    ids = [engine.add_request(p, GREEDY8) for p in PROMPTS]
    for _ in range(3):
        engine.step()
    # After 3 steps the 3-token prompt has forwarded 3 + 2 = 5 tokens: ceil(5 / 4) = 2 blocks;
    # the others 6 + 2 = 8 (2 blocks) and 10 + 2 = 12 (3 blocks).
    assert engine.stats().num_free_blocks == 64 - 2 - 2 - 3
    (out,) = engine.abort(ids[1])
    assert engine.stats().num_free_blocks == 64 - 2 - 3
    assert (out.finished, out.finish_reason) == (True, "abort")
    assert out.token_ids == expected[1].token_ids[:3]
    engine.check_invariants()
    final = run_to_end(engine)
    assert sorted(final) == [ids[0], ids[2]]
    assert final[ids[0]].token_ids == expected[0].token_ids
    assert final[ids[2]].token_ids == expected[2].token_ids
    assert engine.stats().num_free_blocks == 64
    for rid in ids:  # finished or aborted: no longer abortable
        with pytest.raises(ValueError, match=f"request_id '{rid}' is not an unfinished request"):
            engine.abort(rid)


def test_abort_of_a_waiting_request():
    engine = make_tiny_engine(max_num_seqs=1)
    a = engine.add_request(PROMPT, GREEDY8)
    b = engine.add_request([17, 4, 8], GREEDY8)
    engine.step()
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (1, 1, 64 - 2)
    (out,) = engine.abort(b)
    assert out.token_ids == [] and out.finish_reason == "abort" and out.first_scheduled_time is None
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (1, 0, 64 - 2)
    assert list(run_to_end(engine)) == [a]


# ---- stats, order, timestamps --------------------------------------------------------------------


def test_stats_at_known_moments():
    engine = make_tiny_engine(num_kv_blocks=16, max_num_seqs=2)  # blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompt in ([5] * 5, [6] * 6, [7] * 3):
        engine.add_request(prompt, params)

    def counts():
        s = engine.stats()
        return s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks, s.num_steps

    assert counts() == (0, 3, 16, 16, 0)
    engine.step()  # two slots: 5 and 6 tokens take 2 blocks each
    assert counts() == (2, 1, 12, 16, 1)
    engine.step()  # 6 and 7 tokens forwarded: still 2 blocks each
    engine.step()  # 7 and 8
    assert counts() == (2, 1, 12, 16, 3)
    outs = engine.step()  # 8 and 9 (a 3rd block), then both reach max_tokens and free everything
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert counts() == (0, 1, 16, 16, 4)
    engine.step()  # the 3-token prompt: 1 block
    assert counts() == (1, 0, 15, 16, 5)


def test_generate_returns_outputs_in_input_order():
    prompts = ["hello there", "a", "xyz!"]
    max_tokens = [6, 1, 3]  # the first prompt finishes last
    engine = make_tiny_engine()
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    finish_order = []
    original = engine.step

    def step():
        outs = original()
        finish_order.extend(o.request_id for o in outs if o.finished)
        return outs

    engine.step = step
    outs = engine.generate(prompts, params)
    assert finish_order == ["1", "2", "0"]
    assert [o.request_id for o in outs] == ["0", "1", "2"]
    # CharTokenizer: 3 + ord(c) % 94, decoded back as chr(32 + (id - 3) % 90).
    assert [o.prompt_token_ids for o in outs] == [[3 + ord(c) % 94 for c in p] for p in prompts]
    assert [len(o.token_ids) for o in outs] == max_tokens
    for o in outs:
        assert o.text == "".join(chr(32 + (t - 3) % 90) for t in o.token_ids if t >= 3)
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        engine.generate(prompts, params[:2])


def test_timestamps_are_ordered():
    engine = make_tiny_engine(max_num_seqs=2)
    prompts = [PROMPT, [17, 4, 8], [30 + i for i in range(10)]]  # the third waits for a slot
    outs = engine.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (5, 3, 4)])
    for o in outs:
        assert o.arrival_time <= o.first_scheduled_time <= o.first_token_time <= o.finished_time
        assert len(o.token_times) == len(o.token_ids)
        assert o.token_times[0] == o.first_token_time and o.token_times[-1] == o.finished_time
        assert o.token_times == sorted(o.token_times)
        assert 0 < o.running_s <= o.finished_time - o.arrival_time
        assert o.num_preemptions == 0
    assert outs[2].first_scheduled_time >= outs[1].finished_time  # it got the slot the second freed


def test_an_output_kept_from_an_earlier_step_does_not_change():
    engine = make_tiny_engine()
    engine.add_request(PROMPT, greedy(6, logprobs=2))
    kept = []
    while engine.has_unfinished():
        kept += engine.step()
    final = kept[-1]
    assert final.finished and len(final.token_ids) == 6
    for i, out in enumerate(kept):  # output i was made when the request had i + 1 tokens
        assert out.token_ids == final.token_ids[: i + 1]
        assert out.token_times == final.token_times[: i + 1]
        assert out.logprobs == final.logprobs[: i + 1]
        assert out.finished == (i == 5)


# ---- preemption ----------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    GREEDY8,
    SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True, seed=5),
], ids=["greedy", "seeded"])
def test_a_preempted_request_produces_the_tokens_of_an_unpreempted_run(params):
    # Blocks of 2; each request reaches 4 + 8 = 12 tokens = 6 blocks, the pool has 8: the two
    # cannot both finish without one being preempted. b, admitted last, is the victim.
    prompts = [[5, 9, 13, 22], [17, 4, 8, 60]]
    expected = [solo(p, params) for p in prompts]
    engine = make_tiny_engine(block_size=2, num_kv_blocks=8)
    ids = [engine.add_request(p, params) for p in prompts]
    final = run_to_end(engine)
    a, b = final[ids[0]], final[ids[1]]
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert [a.token_ids, b.token_ids] == expected
    assert b.running_s < b.finished_time - b.first_scheduled_time  # it sat out while preempted
    assert engine.stats().num_free_blocks == 8


def test_a_seeded_request_gives_the_same_tokens_with_company():
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=123)
    alone = solo(PROMPT, params)
    others = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=8, ignore_eos=True, seed=9)]
    outs = make_tiny_engine().generate([[17, 4, 8], PROMPT, [30, 31], [40] * 7], [others[0], params, *others[1:]])
    assert outs[1].token_ids == alone
    other_seed = solo(PROMPT, SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=124))
    assert other_seed != alone


def test_a_model_in_another_dtype_runs_as_a_copy_in_the_configured_dtype():
    model = make_tiny_engine().model  # float32 on cpu
    engine = Engine(model, None, EngineConfig(dtype="bfloat16", quantization=None, num_kv_blocks=8))
    assert (engine.model.dtype, engine.kv.k.dtype, engine.plan.dtype) == ((torch.bfloat16,) * 2 + ("bfloat16",))
    assert model.dtype == torch.float32 and model.layers[0].qkv.form.dtype == "float32"  # the given model is unchanged


def test_decode_rows_split_by_length_keep_each_row_its_own_block_table():
    """Eight rows, the first one block shorter than the rest (4-token blocks): with
    decode_group_min_rows=2 the split is tried every step, and where no second group pays it keeps
    one group ordered by length, the short row no longer first. Each request must still produce
    the tokens it produces alone: a block table in length order instead of row order gives a row
    another row's context."""
    lengths = [5, 10, 11, 12, 10, 11, 12, 9]
    prompts = [[3 + (i * 11 + j) % 90 for j in range(n)] for i, n in enumerate(lengths)]
    params = greedy(12)
    engine = make_tiny_engine(max_num_seqs=8, num_kv_blocks=128, decode_group_min_rows=2)
    together = [out.token_ids for out in engine.generate(prompts, params)]
    assert together == [solo(prompt, params) for prompt in prompts]
