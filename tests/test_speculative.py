"""Speculative decoding (nanoserve.speculative): n-gram drafts verified as extra rows of the step.

References, none of them the code under test: a plain-Python n-gram lookup for NgramProposer;
block ids that follow from the allocator's FIFO free list for Scheduler.rollback; the same engine
config without speculation for every engine test (on the batch-invariant plan a row's logits are
the same bits at any step width, so greedy tokens, logprobs and seeded samples must be identical);
and transformers' own logits for the sampled distribution. Every engine test asserts that drafts
were both accepted and rejected (the randomised loads: one fixed load does), so none can pass by
never speculating, and every run checks the block pool after each step and that every block is
free at the end.
"""

from __future__ import annotations

import asyncio
import math
import re
import tempfile
from collections import Counter

import pytest
import torch
from conftest import CharTokenizer, config_of, make_hf_model, nanoserve_model_from_hf
from hypothesis import given, settings
from hypothesis import strategies as st

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.blocks import BlockAllocator, hash_block
from nanoserve.model import blockdot
from nanoserve.output_processor import OutputProcessor
from nanoserve.params import StructuredOutputs
from nanoserve.readback import TokenBatch
from nanoserve.request import Request
from nanoserve.scheduler import Scheduler
from nanoserve.speculative import (
    PLACEHOLDER,
    NgramProposer,
    SpeculationRule,
    SpeculativeConfig,
    observe,
    overhead_rows,
)

needs_build = pytest.mark.skipif(blockdot.library() is None, reason=f"blockdot not built here: {blockdot.failure()}")

BLOCK = 4
# Every request proposes every step (min_acceptance 0: the rule never rests a request), so each test
# meets many drafts; the rule's own choices are tested apart.
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
        "min_acceptance": 0.0}
# Prompts whose continuations (greedy on a tiny random model falls into loops) the lookup finds in
# the request's own tokens: a repeated pattern, a short cycle, a run with a different tail, a short
# prompt with no repeat, and a long one with a period of 10 (all longer than the sliding windows
# below but the short one).
PROMPTS = [[10, 11, 12, 13, 14, 15, 16, 17] * 3, [20 + i % 7 for i in range(30)], [5, 6, 7, 8, 9] * 5 + [40, 41],
           [60, 33, 21], [20 + (7 * i) % 70 for i in range(60)]]
PATHS = {
    "float32-dense": {"dtype": "float32", "quantization": None, "batch_invariant": True},
    "bf16-int4": {"dtype": "bfloat16", "quantization": "int4"},
}
# The families fused_decode.c runs (so the invariant plan runs them), each switch on: a qkv bias,
# per-head q/k norms, sliding windows shorter than the prompts (on all layers, or some).
FAMILIES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 16}),
    "mistral-window": ("mistral", {"sliding_window": 6}),
    "qwen2-window": ("qwen2", {"use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}),
}
_MODELS: dict[tuple, object] = {}


def tiny_model(family: str = "llama", seed: int = 41, lm_head_scale: float = 1.0, **hf_overrides):
    """A cached random transformers model; lm_head_scale sharpens its next-token distribution."""
    key = (family, seed, lm_head_scale, repr(sorted(hf_overrides.items())))
    if key not in _MODELS:
        hf = make_hf_model(family, seed, **hf_overrides)
        with torch.no_grad():
            hf.lm_head.weight.mul_(lm_head_scale)
        _MODELS[key] = hf
    return _MODELS[key]


def spec_config(spec: dict | None = SPEC, path: str = "float32-dense", **fields) -> EngineConfig:
    return config_of(**({"block_size": BLOCK, "num_kv_blocks": 400, "max_num_seqs": 8, "max_num_batched_tokens": 512,
                         "speculative_config": spec} | PATHS[path] | fields))


def engine(hf, spec: dict | None = SPEC, path: str = "float32-dense", **fields) -> Engine:
    """An engine on the batch-invariant plan; spec None: the same config without speculation."""
    built = Engine(nanoserve_model_from_hf(hf), CharTokenizer(hf.config.vocab_size), spec_config(spec, path, **fields))
    assert built.plan.is_batch_invariant, built.plan.render()
    return built


def greedy(max_tokens: int = 40, **overrides) -> SamplingParams:
    return SamplingParams(**({"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True} | overrides))


def check_pool(engine: Engine) -> None:
    """The pool is consistent, and a running request holds exactly the blocks its computed tokens
    fill: a rejected draft's block that was not given back would show here."""
    engine.check_invariants()
    for request in engine.scheduler.running:
        assert len(request.block_ids) == -(-request.num_computed_tokens // BLOCK), request.request_id


def drive(engine: Engine, prompts, params) -> tuple[list, list[dict[str, int]]]:
    """Runs the requests (one SamplingParams each, n = 1) step by step, checking the pool after every
    step. Returns the final outputs in input order and, per step, how many tokens each request got."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    finals, steps, seen = {}, [], {}
    while engine.has_unfinished():
        delivered = {}
        for out in engine.step():
            delivered[out.request_id] = len(out.token_ids) - seen.get(out.request_id, 0)
            seen[out.request_id] = len(out.token_ids)
            if out.finished:
                finals[out.request_id] = out
        steps.append(delivered)
        check_pool(engine)
        assert len(steps) < 3000
    assert engine.allocator.num_free == engine.allocator.num_blocks  # cached blocks stay on the free list
    return [finals[i] for i in ids], steps


def assert_speculated(outputs) -> None:
    """Drafts were verified, some kept and some rejected: the run exercised both paths."""
    drafted = sum(o.num_draft_tokens for o in outputs)
    accepted = sum(o.num_accepted_tokens for o in outputs)
    assert drafted > accepted > 0, (drafted, accepted)


def same_answers(spec_outputs, plain_outputs) -> None:
    for s, p in zip(spec_outputs, plain_outputs, strict=True):
        assert list(s.token_ids) == list(p.token_ids), s.request_id
        assert s.text == p.text and s.finish_reason == p.finish_reason and s.stop_reason == p.stop_reason


def compare(hf, prompts, params, path: str = "float32-dense", spec: dict = SPEC, **fields) -> tuple[list, list]:
    """Runs the same requests with and without speculation on one config; asserts equal answers and
    that drafts were kept and rejected. Returns the speculative run's outputs and steps."""
    spec_outputs, steps = drive(engine(hf, spec, path, **fields), prompts, params)
    plain_outputs, _ = drive(engine(hf, None, path, **fields), prompts, params)
    same_answers(spec_outputs, plain_outputs)
    assert_speculated(spec_outputs)
    assert all(o.num_draft_tokens == o.num_accepted_tokens == 0 for o in plain_outputs)
    return spec_outputs, steps


_DRAFTS: dict[int, tempfile.TemporaryDirectory] = {}


def draft_spec(hf, k: int = 4) -> dict:
    """method "draft_model" whose draft is hf's first layer (with its embedding, final norm and head),
    saved as a checkpoint directory: a smaller model with the target's vocabulary, whose greedy
    proposals the target keeps often but not always."""
    if id(hf) not in _DRAFTS:
        fields = {key: value for key, value in hf.config.to_dict().items() if key != "layer_types"}
        small = type(hf)(type(hf.config)(**(fields | {"num_hidden_layers": 1}))).eval()
        small.load_state_dict({name: t for name, t in hf.state_dict().items() if ".layers.1." not in name})
        _DRAFTS[id(hf)] = tempfile.TemporaryDirectory()
        small.save_pretrained(_DRAFTS[id(hf)].name)
    return {"method": "draft_model", "model": _DRAFTS[id(hf)].name, "num_speculative_tokens": k, "min_acceptance": 0.0}


def spec_for(method: str, hf) -> dict:
    """The speculative_config of a test run by either method."""
    return SPEC if method == "ngram" else draft_spec(hf)


METHODS = ["ngram", "draft"]


# ---- SpeculativeConfig -------------------------------------------------------------------------------


def test_config_parses_vllms_dict():
    parsed = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                      "prompt_lookup_min": 2})
    assert (parsed.method, parsed.num_speculative_tokens, parsed.prompt_lookup_min, parsed.prompt_lookup_max) == \
        ("ngram", 3, 2, 4)
    assert SpeculativeConfig.parse(parsed) is parsed
    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig().speculative_config is None


def test_config_lookup_defaults():
    assert (SpeculativeConfig().prompt_lookup_min, SpeculativeConfig().prompt_lookup_max) == (5, 5)  # vLLM's
    only_max = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_max": 3})
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (3, 3)
    only_min = SpeculativeConfig.parse({"method": "ngram", "prompt_lookup_min": 2})
    assert (only_min.prompt_lookup_min, only_min.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig().num_speculative_tokens == 4


@pytest.mark.parametrize(("spec", "match"), [
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0 must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": -2}, r"num_speculative_tokens=-2"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, r"num_speculative_tokens=2.5"),
    ({"method": "ngram", "num_speculative_tokens": True}, r"num_speculative_tokens=True"),
    ({"method": "ngram", "num_lookahead_slots": 3}, r"unknown keys \['num_lookahead_slots'\]"),
    ({"method": "eagle"}, r"method='eagle' is not one of \['ngram', 'draft_model'\]"),
    ({"method": "draft_model"}, r"method='draft_model' needs model=PATH .*model=None"),
    ({"method": "draft_model", "model": 3}, r"model=3"),
    ({"method": "draft_model", "model": "tiny-draft", "prompt_lookup_max": 3}, r"belong to method='ngram'"),
    ({"method": "ngram", "quantization": "int4"}, r"quantization='int4': only method='draft_model'"),
    ({"method": "ngram", "model": "tiny-draft"}, r"model='tiny-draft'"),
    ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min=4 exceeds prompt_lookup_max=2"),
    ({"method": "ngram", "prompt_lookup_min": 0}, r"prompt_lookup_min=0 must be an integer >= 1"),
    ([("method", "ngram")], r"must be a dict or SpeculativeConfig, got list"),
])
def test_config_refusals_name_the_value(spec, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.parse(spec)
    with pytest.raises(ValueError, match=match):  # and through EngineConfig, where users meet it
        EngineConfig(speculative_config=spec)


def test_a_draft_quantization_is_one_the_engine_knows():
    with pytest.raises(ValueError, match=r"speculative_config quantization='int3' is not one of"):
        EngineConfig(speculative_config={"method": "draft_model", "model": "d", "quantization": "int3"})


def test_speculation_refuses_a_plan_that_is_not_batch_invariant():
    with pytest.raises(ValueError, match=r"speculative_config with batch_invariant=False"):
        EngineConfig(speculative_config=SPEC, batch_invariant=False)
    # "auto" with float32 and no quantization keeps the exact path's torch ops: not invariant.
    hf = tiny_model()
    config = config_of(dtype="float32", quantization=None, speculative_config=SPEC, num_kv_blocks=64)
    with pytest.raises(ValueError, match=r"needs the batch-invariant plan.*the exact path.*batch_invariant=True runs"):
        Engine(nanoserve_model_from_hf(hf), CharTokenizer(97), config)


# ---- NgramProposer -----------------------------------------------------------------------------------


def test_ngram_longest_suffix_wins():
    # The suffix [1, 2, 3] occurs at 0 (followed by 5, 6); its last token alone, [3], occurs later
    # (followed by 7, 8). The longest match is used, not the latest.
    tokens = [1, 2, 3, 5, 6, 9, 3, 7, 8, 1, 2, 3]
    assert NgramProposer(1, 3).propose(tokens, 4) == [5, 6, 9, 3]
    assert NgramProposer(1, 1).propose(tokens, 4) == [7, 8, 1, 2]  # only n = 1: the latest [3]
    assert NgramProposer(2, 2).propose(tokens, 2) == [5, 6]


def test_ngram_latest_earlier_occurrence_wins():
    tokens = [1, 2, 5, 6, 1, 2, 7, 8, 1, 2]
    assert NgramProposer(2, 2).propose(tokens, 4) == [7, 8, 1, 2]  # from the occurrence at 4, not 0
    assert NgramProposer(2, 2).propose(tokens, 1) == [7]


def test_ngram_match_near_the_end_continues_through_its_own_drafts():
    # What follows the match runs into the last tokens, and on through the drafts proposed so far:
    # a pattern of period p gives k drafts, each the token p before it.
    assert NgramProposer(2, 2).propose([7, 7, 7], 4) == [7, 7, 7, 7]  # [7, 7] at 0; period 1
    assert NgramProposer(2, 3).propose([4, 5, 6, 4, 5], 5) == [6, 4, 5, 6, 4]  # [4, 5] at 0; period 3
    assert NgramProposer(1, 1).propose([3, 9, 3], 4) == [9, 3, 9, 3]  # [3] at 0; period 2


def test_ngram_no_match_is_empty():
    assert NgramProposer(1, 3).propose([1, 2, 3, 4], 4) == []  # 4 never occurred before
    assert NgramProposer(2, 3).propose([1, 2, 9, 2], 4) == []  # [2] does, but the shortest allowed is 2
    assert NgramProposer(1, 1).propose([5], 4) == []  # nothing before the suffix at all
    assert NgramProposer(1, 1).propose([5, 5], 0) == []


def test_ngram_an_unaligned_byte_match_is_not_a_token_match():
    # Little-endian bytes: 7 = 07 00 00 00, 5 = 05 00 00 00, 1280 = 00 05 00 00. The bytes of 1280
    # occur three bytes into [7, 5] (07 00 00 [00 05 00 00] 00 ...), straddling two tokens.
    assert NgramProposer(1, 1).propose([7, 5, 9, 1280], 2) == []
    # An aligned 1280 further left is found past the unaligned one, which rfind meets first.
    assert NgramProposer(1, 1).propose([1280, 42, 7, 5, 9, 1280], 2) == [42, 7]
    # The suffix [0, 256] is 00 00 00 00 00 01 00 00; [0, 0, 65536, 0] (65536 = 00 00 01 00) holds
    # those bytes from byte 5, one byte into its second token.
    assert NgramProposer(2, 2).propose([0, 0, 65536, 0, 3, 0, 256], 2) == []


def reference_propose(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The lookup over token lists: for n from the longest, the latest earlier i with
    tokens[i:i + n] equal to the last n tokens (not the suffix itself)."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n - 1, -1, -1):
            if tokens[i:i + n] == suffix:
                extended = list(tokens)  # the sequence as the drafts continue it, period len(tokens) - i - n
                while len(extended) < i + n + k:
                    extended.append(extended[len(extended) - (len(tokens) - i - n)])
                return extended[i + n:i + n + k]
    return []


# Ids whose bytes overlap other ids' at every offset (0, 1, 256, 65536, 16777216, 1280, 5), so
# byte matches across token boundaries are common.
BYTEY = st.sampled_from([0, 1, 5, 7, 256, 1280, 65536, 16777216, 16777217, 2**31 - 1])


@settings(max_examples=300, deadline=None, database=None)
@given(tokens=st.lists(BYTEY | st.integers(0, 3), min_size=0, max_size=24), k=st.integers(0, 6),
       lookup=st.tuples(st.integers(1, 4), st.integers(0, 3)))
def test_ngram_agrees_with_a_token_list_reference(tokens, k, lookup):
    lookup_min, lookup_max = lookup[0], lookup[0] + lookup[1]
    expected = reference_propose(tokens, k, lookup_min, lookup_max) if k >= 1 else []
    assert NgramProposer(lookup_min, lookup_max).propose(tokens, k) == expected


# ---- SpeculationRule: who proposes, how many -----------------------------------------------------------


def decoding_request(request_id: str, token_ids: list[int], max_tokens: int = 30) -> Request:
    """A running request whose last token was sampled, every token computed but that one."""
    request = Request(request_id, token_ids[:-1], greedy(max_tokens), frozenset({2}), arrival_time=0.0)
    request.append_token(token_ids[-1], now=0.0)
    request.num_computed_tokens = request.num_tokens - 1
    return request


LOOP = [5, 6, 7, 8, 9] * 3  # ends in 9; the latest earlier 9 is followed by 5, 6, 7, 8, 9


def test_rule_hands_drafts_out_oldest_first_within_max_step_rows():
    rule = SpeculationRule(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, max_step_rows=8))
    requests = [decoding_request(name, LOOP) for name in "abc"]
    rule.assign(requests)
    # three rows of their own, then a's four drafts, b's one, none left for c
    assert [r.draft_token_ids for r in requests] == [[5, 6, 7, 8], [5], []]
    unlimited = SpeculationRule(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, max_step_rows=None))
    unlimited.assign(requests)
    assert [r.draft_token_ids for r in requests] == [[5, 6, 7, 8]] * 3


def test_rule_gives_no_drafts_to_a_prefill_a_pending_token_or_past_max_tokens():
    rule = SpeculationRule(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, max_step_rows=None))
    prefill, pending = decoding_request("prefill", LOOP), decoding_request("pending", LOOP)
    prefill.num_computed_tokens = 3
    pending.num_pending_tokens = 1
    capped = decoding_request("capped", LOOP, max_tokens=3)  # one out of 3: one draft, then the token after it
    last = decoding_request("last", LOOP, max_tokens=2)  # one out of 2: only the last token is left
    rule.assign([prefill, pending, capped, last])
    assert [r.draft_token_ids for r in (prefill, pending, capped, last)] == [[], [], [5], []]


def test_rule_rests_a_request_whose_drafts_miss_and_probes_it_again():
    rule = SpeculationRule(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, min_acceptance=0.25,
                                             probe_every=3, max_step_rows=None))
    request = decoding_request("a", LOOP)
    observe(request, 4, 0)  # acceptance 1.0 -> 0.5; one draft fewer next time
    assert (request.spec_acceptance, request.spec_k) == (0.5, 3)
    rule.assign([request])
    assert request.draft_token_ids == [5, 6, 7]
    observe(request, 3, 0)
    observe(request, 2, 0)  # acceptance 0.125: under the floor
    assert (request.spec_acceptance, request.spec_k, request.num_drafts, request.num_draft_tokens) == (0.125, 1, 3, 9)
    drafts = []
    for _ in range(6):
        rule.assign([request])
        drafts.append(request.draft_token_ids)
    assert drafts == [[], [], [5], [], [], [5]]  # every third step a probe
    observe(request, 1, 1)  # kept: acceptance back over the floor, and two more drafts next time
    assert (request.spec_acceptance, request.spec_k, request.num_accepted_tokens) == (0.5625, 3, 1)
    rule.assign([request])
    assert request.draft_token_ids == [5, 6, 7]


def test_measured_step_times_rest_speculation_that_costs_more_per_token():
    rule = SpeculationRule(SpeculativeConfig(overhead_rows=3.0, probe_every=4))
    requests = [decoding_request("a", [5, 6, 7] * 3)]  # its drafts: the lookup finds [5, 6, 7, 5]

    def drafting_steps(n: int) -> list[int]:
        steps = []
        for _ in range(n):
            rule.assign(requests)
            if requests[0].draft_token_ids:
                steps.append(rule.num_steps)
        return steps

    assert drafting_steps(4) == [1, 2, 3, 4]  # nothing measured: the cost model alone
    rule.observe_step(True, 5, 0.05)  # 10 ms a token with drafts
    assert drafting_steps(4) == [5, 6, 7]  # step 8 refreshes the plain arm, unmeasured yet
    rule.observe_step(False, 1, 0.005)  # 5 ms a token without
    assert drafting_steps(8) == [12, 16]  # drafting costs more: only every 4th step drafts
    for _ in range(4):  # 2 ms a token: the mean goes 10, 8, 6.5, 5.375, 4.53 ms (weight 0.25)
        rule.observe_step(True, 5, 0.01)
    assert rule.seconds_per_token[True] == pytest.approx(0.00453125)
    assert drafting_steps(8) == [17, 18, 19, 21, 22, 23]  # it pays now: every 4th step does not draft
    rule.observe_step(False, 0, 1.0)  # a step that gave nothing counts nowhere
    assert rule.seconds_per_token[False] == 0.005
    fixed = SpeculationRule(SpeculativeConfig(min_acceptance=0.0))
    fixed.observe_step(True, 1, 1.0)
    fixed.observe_step(False, 1, 0.001)
    assert all(fixed.speculating() for _ in range(40))  # a fixed floor: the caller chose


def test_overhead_rows_is_a_over_b_of_a_step_costing_a_plus_b_rows():
    # a step of R rows costs 3 + R: 4 at one row, 12 at nine, so a / b = 3 / 1
    assert overhead_rows(4.0, 12.0, 9) == pytest.approx(3.0)
    assert overhead_rows(2.0, 2.0, 5) > 1e6  # free rows: any acceptance pays
    assert overhead_rows(1.0, 9.0, 5) == 0.0  # rows dearer than the step they are in: clamped at 0


def test_rule_threshold_rises_with_the_steps_rows_as_the_cost_model_says():
    rule = SpeculationRule(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, overhead_rows=3.0))
    assert rule.threshold(1) == pytest.approx(1 / 4)
    assert rule.threshold(16) == pytest.approx(16 / 19)
    # By hand: a step of R rows costing 3 + R. At R = 1, four drafts kept at rate 0.5 give (1 + 2) / (3 + 5)
    # tokens a unit of time against 1 / 4 without: worth it; at R = 16, (16 + 2) / (3 + 20) < 16 / 19.
    assert (1 + 2) / (3 + 5) > 1 / 4 and (16 + 2) / (3 + 20) < 16 / 19
    alone = decoding_request("alone", LOOP)
    alone.spec_acceptance = 0.5
    rule.assign([alone])
    assert alone.draft_token_ids == [5, 6, 7, 8]
    crowd = [decoding_request(f"r{i}", LOOP) for i in range(16)]
    for request in crowd:
        request.spec_acceptance = 0.5
    rule.assign(crowd)
    assert all(r.draft_token_ids == [] for r in crowd)
    assert rule.needs_calibration is False
    assert SpeculationRule(SpeculativeConfig()).needs_calibration is True
    assert SpeculationRule(SpeculativeConfig(min_acceptance=0.0)).needs_calibration is False


def test_the_engine_times_its_steps_for_the_rule_and_returns_the_blocks():
    built = engine(tiny_model(), {"method": "ngram", "num_speculative_tokens": 4})
    assert built.speculation.rule.needs_calibration is False  # calibrated: overhead_rows is a number now
    assert built.speculation.rule.overhead_rows >= 0.0
    check_pool(built)
    assert built.allocator.num_free == built.allocator.num_blocks
    assert built.speculation.rule.draft_rows == 0.0  # ngram's proposals cost no forward
    hf = tiny_model()
    drafting = engine(hf, draft_spec(hf) | {"min_acceptance": None})
    assert drafting.speculation.rule.draft_rows > 0.0  # a draft token costs a forward of the draft
    assert drafting.allocator.num_free == drafting.allocator.num_blocks


def test_the_rule_charges_a_draft_models_forward_to_the_threshold():
    # alpha > R (1 + d / b) / (R + a / b): with a / b = 3 and a draft token at d / b = 1, a lone
    # request needs 2 / 4; at 5 rows 10 / 8, more than every draft kept: never.
    rule = SpeculationRule(SpeculativeConfig(method="draft_model", model="d", overhead_rows=3.0), draft_rows=1.0)
    assert rule.threshold(1) == pytest.approx(0.5) and rule.threshold(5) == pytest.approx(1.25)
    requests = [decoding_request("a", [5, 6, 7]), decoding_request("b", [5, 6, 7])]
    # Two running requests: a's threshold is 2 * 2 / (2 + 3) = 0.8; after its 4 drafts, b's is 6 * 2 / 9 > 1.
    requests[0].spec_acceptance, requests[1].spec_acceptance = 0.85, 1.0
    rule.assign(requests)
    assert requests[0].draft_token_ids == [PLACEHOLDER] * 4  # placeholders: the draft model fills them
    assert requests[1].draft_token_ids == []
    requests[0].spec_acceptance = 0.75
    rule.assign(requests)
    assert requests[0].draft_token_ids == [] and requests[1].draft_token_ids == [PLACEHOLDER] * 4
    # Under 0.8 a request rests and probes every probe_every (16) steps; b, facing a threshold over
    # 1 once a drafts again, never probes: no acceptance could pay for the draft's forward.
    requests[0].spec_acceptance, requests[1].spec_acceptance = 0.85, 0.1
    for _ in range(40):
        rule.assign(requests)
        assert requests[1].draft_token_ids == []
    requests[0].spec_acceptance = 0.5
    probes = 0
    for _ in range(40):
        rule.assign(requests)
        probes += requests[0].draft_token_ids == [PLACEHOLDER]
    assert probes == 40 // 16


def test_a_draft_models_catch_up_must_pay_for_itself():
    rule = SpeculationRule(SpeculativeConfig(method="draft_model", model="d", overhead_rows=0.0, probe_every=4))
    rule.catch_up_seconds = 0.001  # 1 ms a token caught up
    fresh = decoding_request("a", list(range(10, 60)), max_tokens=30)  # 50 tokens, 1 output; the draft saw none
    fresh.spec_acceptance = 1.0
    rule.assign([fresh])
    assert fresh.draft_token_ids == [PLACEHOLDER] * 4  # nothing measured: no charge
    # Drafting saves 0.5 ms a token over the 29 tokens the request may still give: 14.5 ms, under the
    # 48 ms of catching up on 50 tokens past steady drafting's 2.
    rule.observe_step(True, 5, 5 * 0.0045)
    rule.observe_step(False, 1, 0.005)
    rule.num_steps = 0  # steps 1-3 draft (drafting is cheaper), the 4th refreshes the plain arm
    rule.assign([fresh])
    assert fresh.draft_token_ids == []
    fresh.num_draft_computed = 20  # 30 tokens behind: 28 ms past steady, more than 14.5 ms
    rule.assign([fresh])
    assert fresh.draft_token_ids == []
    fresh.num_draft_computed = 40  # 10 behind: 8 ms
    rule.assign([fresh])
    assert fresh.draft_token_ids == [PLACEHOLDER] * 4
    # Drafting dearer than plain steps: only probing steps (every 4th) draft, and a probe's catch-up
    # may take 2% of the decode time since a step last drafted.
    rule.observe_step(True, 5, 5 * 0.2)  # the spec arm's mean: 4.5 + 0.25 (200 - 4.5) ms
    rule.num_steps, fresh.num_draft_computed = 0, 0  # 48 ms behind: a probe needs 2.4 s of plain steps
    for _ in range(8):
        rule.assign([fresh])
        assert fresh.draft_token_ids == []
    for _ in range(239):
        rule.observe_step(False, 1, 0.01)  # 2.39 s: 2% of it is 47.8 ms
    rule.num_steps = 3
    rule.assign([fresh])
    assert rule.probing and fresh.draft_token_ids == []
    rule.observe_step(False, 1, 0.02)  # 2.41 s
    rule.num_steps = 3
    rule.assign([fresh])
    assert rule.probing and fresh.draft_token_ids == [PLACEHOLDER] * 4
    rule.observe_step(True, 5, 0.05)
    assert rule.seconds_since_drafting == 0.0
    fixed = SpeculationRule(SpeculativeConfig(method="draft_model", model="d", min_acceptance=0.0))
    fixed.catch_up_seconds = 1.0
    fixed.observe_step(True, 1, 1.0)
    fixed.observe_step(False, 1, 0.001)
    fixed.assign([fresh])
    assert fresh.draft_token_ids == [PLACEHOLDER] * 4  # a fixed floor: the caller chose


# ---- Scheduler: drafts and rollback ------------------------------------------------------------------


def decoding(scheduler: Scheduler, prompt_len: int, first_token: int = 50) -> Request:
    """A request admitted, its prompt forwarded and one token sampled (as the engine does it)."""
    request = Request("r", list(range(10, 10 + prompt_len)), greedy(30), frozenset({2}), arrival_time=0.0)
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.advance(out)
    request.append_token(first_token, now=0.0)
    return request


def test_drafts_are_forwarded_in_blocks_and_rejected_ones_come_back():
    scheduler = Scheduler(BlockAllocator(16), BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                          enable_prefix_caching=True)
    alloc = scheduler.allocator
    request = decoding(scheduler, 6)  # prompt at positions 0..5 in blocks [0, 1]; token 50 at 6
    assert request.block_ids == [0, 1] and (request.num_tokens, request.num_computed_tokens) == (7, 6)
    request.draft_token_ids = [51, 52, 53, 54]
    out = scheduler.schedule()
    item = out.scheduled[0]
    # the last token and four drafts: positions 6..10, so block 2 (positions 8..11) is taken
    assert (item.num_new_tokens, item.samples, item.draft_token_ids) == (5, True, [51, 52, 53, 54])
    assert request.block_ids == [0, 1, 2] and out.num_batched_tokens == 5
    scheduler.advance(out)
    assert request.num_computed_tokens == 11
    # The step registered only block 0: block 1 ends at position 7, a token the request does not hold yet.
    assert alloc.cached == {hash_block(None, range(10, 14)): 0}
    # The target kept draft 51 and said 60 where 52 was drafted: three drafts rejected.
    request.append_token(51, now=0.0)
    request.append_token(60, now=0.0)
    scheduler.rollback(request, 3)
    assert request.num_computed_tokens == 8  # positions 0..7: the prompt, 50 and 51; 60 is next
    assert request.block_ids == [0, 1]  # block 2 held only rejected drafts (positions 8..10)
    assert list(alloc.free_ids) == [*range(3, 16), 2] and alloc.ref_counts[2] == 0
    assert alloc.block_hashes[2] is None  # never registered: its K/V is garbage
    alloc.check_invariants(scheduler.owners())
    # The next step forwards 60 at position 8, in block 3 (the front of the free list), and
    # registers block 1, whose positions 4..7 now hold tokens the request has: 14, 15, 50, 51.
    request.draft_token_ids = []
    out = scheduler.schedule()
    assert [(s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == [(1, [])]
    assert request.block_ids == [0, 1, 3]
    scheduler.advance(out)
    block1 = hash_block(hash_block(None, range(10, 14)), [14, 15, 50, 51])
    assert alloc.cached == {hash_block(None, range(10, 14)): 0, block1: 1}
    alloc.check_invariants(scheduler.owners())
    scheduler.finish(request)
    assert alloc.num_free == 16
    alloc.check_invariants(scheduler.owners())


def test_rollback_in_the_same_block_frees_nothing_and_all_rejected_frees_the_drafts_blocks():
    scheduler = Scheduler(BlockAllocator(16), BLOCK, max_num_seqs=4, max_num_batched_tokens=64,
                          enable_prefix_caching=True)
    request = decoding(scheduler, 4)  # prompt in block 0; 50 at position 4
    request.draft_token_ids = [51, 52]
    out = scheduler.schedule()  # positions 4..6: block 1
    assert request.block_ids == [0, 1]
    scheduler.advance(out)
    request.append_token(51, now=0.0)
    request.append_token(61, now=0.0)
    scheduler.rollback(request, 1)  # 52 rejected: position 6 is still in block 1, which 51 needs
    assert (request.num_computed_tokens, request.block_ids) == (6, [0, 1])
    scheduler.allocator.check_invariants(scheduler.owners())
    # Now every draft rejected, across a block boundary: 61 at 6, drafts at 7..11 (blocks 1, 2).
    request.draft_token_ids = [1, 2, 3, 4, 5]
    out = scheduler.schedule()
    assert out.scheduled[0].num_new_tokens == 6 and request.block_ids == [0, 1, 2]
    scheduler.advance(out)
    request.append_token(70, now=0.0)
    scheduler.rollback(request, 5)
    assert (request.num_computed_tokens, request.block_ids) == (7, [0, 1])
    assert list(scheduler.allocator.free_ids)[-1] == 2
    assert scheduler.allocator.cached == {hash_block(None, range(10, 14)): 0}
    scheduler.allocator.check_invariants(scheduler.owners())


def test_drafts_fit_the_token_budget_and_never_preempt():
    # Budget: 1 + 2 drafts fit in 3 tokens; the rest of the drafts are not forwarded.
    scheduler = Scheduler(BlockAllocator(16), BLOCK, max_num_seqs=4, max_num_batched_tokens=3)
    request = decoding(scheduler, 3)
    request.draft_token_ids = [51, 52, 53, 54]
    item = scheduler.schedule().scheduled[0]
    assert (item.num_new_tokens, item.draft_token_ids) == (3, [51, 52])
    # Two requests in a budget of 6: a's token and four drafts, then b's token and no room for drafts.
    scheduler = Scheduler(BlockAllocator(16), BLOCK, max_num_seqs=4, max_num_batched_tokens=6)
    a = Request("a", [10, 11, 12], greedy(9), frozenset({2}), arrival_time=0.0)
    b = Request("b", [20, 21], greedy(9), frozenset({2}), arrival_time=0.0)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.advance(scheduler.schedule())
    a.append_token(50, now=0.0)
    b.append_token(60, now=0.0)
    a.draft_token_ids, b.draft_token_ids = [51, 52, 53, 54], [61, 62]
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == \
        [("a", 5, [51, 52, 53, 54]), ("b", 1, [])]
    assert out.num_batched_tokens == 6
    # Blocks: two requests fill a 3-block pool; a's drafts would need a fourth block, so a goes
    # without them rather than preempting b.
    scheduler = Scheduler(BlockAllocator(3), BLOCK, max_num_seqs=4, max_num_batched_tokens=64)
    a = Request("a", [10, 11, 12, 13, 14], greedy(5), frozenset({2}), arrival_time=0.0)
    b = Request("b", [20, 21, 22], greedy(5), frozenset({2}), arrival_time=0.0)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.advance(scheduler.schedule())  # a in blocks [0, 1], b in [2]
    a.append_token(50, now=0.0)
    b.append_token(60, now=0.0)
    a.draft_token_ids = [51, 52, 53]  # positions 5..8: a third block for a
    out = scheduler.schedule()
    assert [(s.request.request_id, s.num_new_tokens, s.draft_token_ids) for s in out.scheduled] == \
        [("a", 1, []), ("b", 1, [])]
    assert out.preempted == [] and scheduler.allocator.num_free == 0


# ---- the draft model's own checks --------------------------------------------------------------------


_SAVED: list[tempfile.TemporaryDirectory] = []  # kept alive with the module


def saved(hf_model) -> str:
    """A checkpoint directory holding hf_model."""
    directory = tempfile.TemporaryDirectory()
    _SAVED.append(directory)
    hf_model.save_pretrained(directory.name)
    return directory.name


def test_a_draft_with_another_vocabulary_or_too_few_positions_is_refused():
    hf = tiny_model()
    other_vocab = saved(make_hf_model("llama", 5, vocab_size=101))
    with pytest.raises(ValueError, match=r"draft model has vocab_size=101, the target 97"):
        engine(hf, {"method": "draft_model", "model": other_vocab, "min_acceptance": 0.0})
    short = saved(make_hf_model("llama", 5, max_position_embeddings=64))
    with pytest.raises(ValueError, match=r"draft model positions 64 tokens, under the engine's max_model_len=256"):
        engine(hf, {"method": "draft_model", "model": short, "min_acceptance": 0.0})
    engine(hf, {"method": "draft_model", "model": short, "min_acceptance": 0.0}, max_model_len=64)  # within reach


def test_a_draft_whose_tokenizer_maps_tokens_elsewhere_is_refused():
    from nanoserve.draft import check_vocabulary

    class Vocab:
        def __init__(self, vocab: dict[str, int]) -> None:
            self.vocab = vocab

        def get_vocab(self) -> dict[str, int]:
            return self.vocab

    model = nanoserve_model_from_hf(tiny_model())
    target = Vocab({"a": 0, "b": 1, "c": 2})
    check_vocabulary(model, Vocab({"a": 0, "b": 1, "c": 2}), model, target)
    check_vocabulary(model, None, model, target)  # no tokenizer to compare: the sizes alone
    with pytest.raises(ValueError, match=r"tokenizer \(3 tokens\) is not the target's \(3 tokens\).*'b'"):
        check_vocabulary(model, Vocab({"a": 0, "b": 2, "c": 1}), model, target)


@needs_build
@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_target_as_its_own_draft_keeps_every_draft(path):
    # On the batch-invariant plan the draft's logits are the target's bits, so its greedy drafts are
    # the target's greedy tokens: every one is kept (a verifier that rejected any would show here).
    hf = tiny_model()
    spec = {"method": "draft_model", "model": saved(hf), "num_speculative_tokens": 3, "min_acceptance": 0.0,
            "quantization": PATHS[path]["quantization"]}  # the draft laid out as the target is
    outputs, steps = drive(engine(hf, spec, path), PROMPTS, [greedy(40)] * len(PROMPTS))
    plain, _ = drive(engine(hf, None, path), PROMPTS, [greedy(40)] * len(PROMPTS))
    same_answers(outputs, plain)
    # The prompt's step gives token 1; then 9 steps of 3 kept drafts and the row after them give 36,
    # and max_tokens leaves the last step 2 drafts (and its third token): 29 drafts, every one kept.
    for out in outputs:
        assert out.num_accepted_tokens == out.num_draft_tokens == 29, out.request_id
    assert max(n for step in steps for n in step.values()) == 4  # 3 drafts and the row after them


# ---- greedy: the same tokens with and without speculation ---------------------------------------------


@needs_build
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", sorted(FAMILIES))
@pytest.mark.parametrize("path", sorted(PATHS))
def test_greedy_tokens_are_the_same_with_and_without_speculation(name, path, method):
    family, overrides = FAMILIES[name]
    hf = tiny_model(family, 43, **overrides)
    outputs, steps = compare(hf, PROMPTS, [greedy(40)] * len(PROMPTS), path, spec_for(method, hf))
    assert max(n for step in steps for n in step.values()) > 1  # steps that gave a request several tokens
    if "window" in name:  # every draft sits past the window: the prompts that repeat are longer than it
        assert min(len(p) for p in PROMPTS[:3]) > hf.config.sliding_window


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_greedy_tokens_on_a_mixture_of_experts_are_the_same_with_and_without_speculation(method):
    # Qwen3-MoE, 8 experts, top 2: verifying k drafts as k + 1 rows sends them to other experts'
    # groups than one row at a time would, and changes nothing (the draft model: its first layer).
    hf = tiny_model("qwen3_moe", 43, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    norm_topk_prob=True)
    compare(hf, PROMPTS, [greedy(40)] * len(PROMPTS), "float32-dense", spec_for(method, hf))


@needs_build
def test_greedy_with_default_lookup_and_wide_batches():
    # vLLM's default lookup (5..5), k = 2, and more requests than max_step_rows leaves drafts for.
    hf = tiny_model(seed=44)
    prompts = PROMPTS * 2
    compare(hf, prompts, [greedy(30 + i) for i in range(len(prompts))],
            spec={"method": "ngram", "num_speculative_tokens": 2, "max_step_rows": 12}, max_num_seqs=10)


# ---- any load: a request's answer is its quiet, unspeculated one ------------------------------------------

LOAD_SCALE = 10.0  # a sharper model: sampled requests' drafts are kept too
LOAD_MAX_TOKENS = [30, 24, 28, 20, 26, 30]
_QUIET: dict[tuple[int, int, bool], tuple] = {}


def load_prompts(hf) -> list[list[int]]:
    return PROMPTS + [copying_prompt(hf)]


def load_params(index: int, sampled: bool) -> SamplingParams:
    common = {"max_tokens": LOAD_MAX_TOKENS[index], "ignore_eos": True, "logprobs": 2}
    if not sampled:
        return SamplingParams(temperature=0.0, **common)
    return SamplingParams(temperature=1.0, top_k=20, seed=100 + index, **common)


def answer(output) -> tuple[list[int], list[dict[int, float]]]:
    return list(output.token_ids), [dict(d) for d in output.logprobs]


def quiet(hf, index: int, sampled: bool) -> tuple:
    """The request alone, without speculation, its prompt in one step, nothing cached, no preemption."""
    key = (id(hf), index, sampled)
    if key not in _QUIET:
        alone = engine(hf, None, max_num_seqs=1, enable_prefix_caching=False)
        _QUIET[key] = answer(alone.generate([load_prompts(hf)[index]], load_params(index, sampled))[0])
    return _QUIET[key]


def run_load(hf, requests: list[tuple[int, bool, int]], spec: dict, **fields) -> list:
    """Adds each (prompt, sampled, arrival step) request at its step; checks the pool after every
    step and each answer against the quiet one. Returns the final outputs in request order."""
    busy = engine(hf, spec, **fields)
    prompts = load_prompts(hf)
    pending = sorted(enumerate(requests), key=lambda item: item[1][2])
    ids, finals, step = {}, {}, 0
    while pending or busy.has_unfinished():
        while pending and pending[0][1][2] <= step:
            n, (index, sampled, _) = pending.pop(0)
            ids[busy.add_request(prompts[index], load_params(index, sampled))] = n
        finals |= {ids[o.request_id]: o for o in busy.step() if o.finished}
        check_pool(busy)
        step += 1
        assert step < 3000
    assert busy.allocator.num_free == busy.allocator.num_blocks
    for n, (index, sampled, _) in enumerate(requests):
        assert answer(finals[n]) == quiet(hf, index, sampled), (n, index, sampled)  # logprobs: exact floats
    return [finals[n] for n in range(len(requests))]


@st.composite
def spec_loads(draw):
    lookup_min = draw(st.integers(1, 3))
    return {
        "requests": draw(st.lists(st.tuples(st.integers(0, len(PROMPTS)), st.booleans(), st.integers(0, 6)),
                                  min_size=1, max_size=7)),
        "spec": {"num_speculative_tokens": draw(st.integers(1, 6)),
                 "min_acceptance": draw(st.sampled_from([0.0, 0.25])),
                 "max_step_rows": draw(st.sampled_from([None, 4, 16]))}
        | draw(st.sampled_from([{"method": "ngram", "prompt_lookup_min": lookup_min,
                                 "prompt_lookup_max": lookup_min + draw(st.integers(0, 2))},
                                {"method": "draft_model"}])),
        "max_num_seqs": draw(st.integers(1, 8)),
        "max_num_batched_tokens": draw(st.sampled_from([3, 5, 8, 13, 512])),
        "enable_prefix_caching": draw(st.booleans()),
        "num_kv_blocks": draw(st.sampled_from([32, 400])),  # 32: a request of 90 tokens fits, three do not
    }


@needs_build
@settings(max_examples=100, deadline=None, database=None)
@given(load=spec_loads())
def test_a_requests_answer_is_its_quiet_one_under_any_load_with_speculation(load):
    hf = tiny_model(lm_head_scale=LOAD_SCALE)
    spec = load.pop("spec")
    if spec["method"] == "draft_model":
        spec["model"] = draft_spec(hf)["model"]
    run_load(hf, load.pop("requests"), spec, **load)


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_one_load_meets_chunks_prefix_hits_preemption_and_drafts_both_ways(method):
    requests = [(4, False, 0), (5, True, 0), (0, False, 1), (5, False, 1), (2, True, 2), (1, True, 2), (0, True, 3),
                (3, False, 4), (5, True, 5)]
    hf = tiny_model(lm_head_scale=LOAD_SCALE)
    outputs = run_load(hf, requests, spec_for(method, hf), max_num_seqs=6, max_num_batched_tokens=8, num_kv_blocks=32)
    assert sum(o.num_preemptions for o in outputs) > 0
    assert sum(o.num_cached_tokens for o in outputs) > 0
    assert_speculated([o for o, (_, sampled, _) in zip(outputs, requests, strict=True) if sampled])
    assert_speculated([o for o, (_, sampled, _) in zip(outputs, requests, strict=True) if not sampled])


# ---- everything else keeps working --------------------------------------------------------------------


def last_of_a_step(steps, request_id: str) -> set[int]:
    """Output indices that were the last token a step gave `request_id`."""
    ends, total = set(), 0
    for step in steps:
        if request_id in step:
            total += step[request_id]
            ends.add(total - 1)
    return ends


def continued(hf, token_ids: list[int], num_tokens: int) -> list[int]:
    """token_ids and transformers' greedy continuation of them, num_tokens long."""
    ids = list(token_ids)
    with torch.no_grad():
        for _ in range(num_tokens):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids


def copying_prompt(hf) -> list[int]:
    """A pattern and the start of the model's greedy continuation of it, loops included: the output
    goes on with that continuation, and the lookup finds its loops in the prompt, so accepted drafts
    bring tokens the output has not had yet."""
    return continued(hf, [10, 11, 12, 13, 14, 15, 16, 17], 8)


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_stop_token_inside_accepted_drafts_ends_the_request_there(method):
    hf = tiny_model()
    spec = spec_for(method, hf)
    prompt = copying_prompt(hf)
    (free,), steps = drive(engine(hf, spec), [prompt], [greedy(40)])
    ends = last_of_a_step(steps, free.request_id)
    tokens = list(free.token_ids)
    # A token first seen at index i, where the step that gave it also gave tokens after it.
    inside = [i for i, t in enumerate(tokens) if t not in tokens[:i] and i not in ends]
    assert inside, (tokens, sorted(ends))
    stop_at = inside[0]
    outputs, _ = compare(hf, [prompt, PROMPTS[1]], [greedy(40, stop_token_ids=[tokens[stop_at]]), greedy(40)],
                         spec=spec)
    assert list(outputs[0].token_ids) == tokens[:stop_at + 1]
    assert outputs[0].finish_reason == "stop" and outputs[0].stop_reason == tokens[stop_at]


@needs_build
def test_stop_string_inside_accepted_drafts_cuts_where_plain_decoding_cuts():
    hf = tiny_model()
    prompt = copying_prompt(hf)
    (free,), steps = drive(engine(hf), [prompt], [greedy(40)])
    ends = last_of_a_step(steps, free.request_id)
    tokens = list(free.token_ids)
    text = CharTokenizer(97).decode(tokens)
    assert len(text) == len(tokens)  # one character a token: text index = token index
    # Two characters first seen at i, i + 1, where the step that gave i + 1 gave tokens after it.
    inside = [i for i in range(len(text) - 1) if text.find(text[i:i + 2]) == i and i + 1 not in ends]
    assert inside, (text, sorted(ends))
    i = inside[0]
    stop = text[i:i + 2]
    outputs, _ = compare(hf, [prompt, PROMPTS[2]], [greedy(40, stop=[stop]), greedy(40)])
    assert list(outputs[0].token_ids) == tokens[:i + 2]
    assert outputs[0].text == text[:i] and outputs[0].finish_reason == "stop" and outputs[0].stop_reason == stop


@needs_build
def test_the_step_profile_counts_the_drafts_the_requests_kept():
    # Each step's sample counts drafts verified and kept; a request that stops inside its drafts
    # (on a kept draft, or on a row that rejected its draft) keeps only those before the stop.
    from nanoserve.instruments.recording import StepRecorder

    hf = tiny_model()
    prompt = copying_prompt(hf)
    (free,), _ = drive(engine(hf), [prompt], [greedy(40)])
    tokens = list(free.token_ids)
    stops = [greedy(40, stop_token_ids=[t]) for t in dict.fromkeys(tokens[1:8])]
    recorded = engine(hf)
    recorded.recorder = StepRecorder()
    outputs, _ = drive(recorded, [prompt] * len(stops) + PROMPTS[:2], stops + [greedy(40)] * 2)
    assert_speculated(outputs)
    samples = recorded.recorder.samples
    assert sum(s.num_draft_tokens for s in samples) == sum(o.num_draft_tokens for o in outputs)
    assert sum(s.num_accepted_tokens for s in samples) == sum(o.num_accepted_tokens for o in outputs)


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_max_tokens_is_never_exceeded(method):
    hf = tiny_model()
    (free,), _ = drive(engine(hf, None), [PROMPTS[0]], [greedy(16)])
    outputs, _ = compare(hf, [PROMPTS[0]] * 16, [greedy(m) for m in range(1, 17)], spec=spec_for(method, hf))
    for m, out in enumerate(outputs, start=1):
        assert list(out.token_ids) == list(free.token_ids)[:m] and out.finish_reason == "length"


def first_of_a_step(steps, request_id: str) -> set[int]:
    """Output indices that were the first token a step gave `request_id`."""
    starts, total = set(), 0
    for step in steps:
        if request_id in step:
            starts.add(total)
            total += step[request_id]
    return starts


@needs_build
def test_min_tokens_counts_the_drafts_before_a_row():
    # A stop token first sampled at index i by a draft row (not its step's first row), with
    # min_tokens = i: that row's history must count the drafts before it, or it masks the stop.
    hf = tiny_model()
    prompt = copying_prompt(hf)
    (free,), steps = drive(engine(hf), [prompt], [greedy(40)])
    starts = first_of_a_step(steps, free.request_id)
    tokens = list(free.token_ids)
    candidates = [i for i, t in enumerate(tokens) if t not in tokens[:i] and i not in starts]
    assert candidates, (tokens, sorted(starts))
    i = candidates[0]
    params = [greedy(40, stop_token_ids=[tokens[i]], min_tokens=i), greedy(40, stop_token_ids=[tokens[i]], min_tokens=i + 1)]
    outputs, _ = compare(hf, [prompt, prompt], params)
    assert list(outputs[0].token_ids) == tokens[:i + 1] and outputs[0].finish_reason == "stop"
    assert tokens[i] not in list(outputs[1].token_ids)[:i + 1]  # one token later: held back at i too


@needs_build
def test_logprobs_are_the_same_with_and_without_speculation():
    hf = tiny_model()
    params = [greedy(30, logprobs=3)] * 3
    spec = drive(engine(hf), PROMPTS[:3], params)[0]
    plain = drive(engine(hf, None), PROMPTS[:3], params)[0]
    same_answers(spec, plain)
    assert_speculated(spec)
    for s, p in zip(spec, plain, strict=True):
        assert len(s.logprobs) == len(s.token_ids)
        assert [dict(d) for d in s.logprobs] == [dict(d) for d in p.logprobs]  # exact floats


@needs_build
@pytest.mark.parametrize("penalties", [{"repetition_penalty": 1.3}, {"frequency_penalty": 0.05},
                                       {"presence_penalty": 0.3, "frequency_penalty": 0.1}])
def test_penalties_see_the_drafts_before_a_row(penalties):
    # A sharper model, whose loops survive small penalties (so drafts are still kept) and end where
    # the penalty overtakes them. Frequency and presence count output tokens, so a draft row that
    # did not count the drafts before it would end a loop a token late; repetition's set of seen
    # tokens already holds every draft (the lookup draws them from the request's own tokens).
    hf = tiny_model(lm_head_scale=10.0)
    prompts = PROMPTS[:3] + [copying_prompt(hf)]
    outputs, _ = compare(hf, prompts, [greedy(40, **penalties)] * 4)
    unpenalised, _ = drive(engine(hf), prompts, [greedy(40)] * 4)
    assert any(list(o.token_ids) != list(u.token_ids) for o, u in zip(outputs, unpenalised, strict=True))


def ids_of(text: str) -> list[int]:
    """CharTokenizer's ids for `text` as its decode reads them (its encode is not decode's inverse)."""
    ids = [3 + ord(c) - 32 for c in text]
    assert CharTokenizer(97).decode(ids) == text
    return ids


STRUCTURED = [("abcdabcdabcd", "(ab|ba)+c"), ("abcdabcdabcd", "[a-d]{12}"), ("abababababab", "[a-d]{12}"),
              ("the cat, the cat, the cat", "(the (cat|dog), ){3,6}")]


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_structured_outputs_with_drafts(method, monkeypatch):
    pytest.importorskip("xgrammar")
    hf = tiny_model()
    # A draft model drafts within the grammar and stops at its end (the stop token the mask leaves):
    # the placeholders past it are dropped before the forward.
    dropped = []
    drop_drafts = Scheduler.drop_drafts
    monkeypatch.setattr(Scheduler, "drop_drafts", lambda self, out, item, num_kept: (
        dropped.append(len(item.draft_token_ids) - num_kept), drop_drafts(self, out, item, num_kept))[1])
    prompts = [ids_of(text) for text, _ in STRUCTURED] + [ids_of("abababababab")]
    params = [greedy(40, structured_outputs=StructuredOutputs(regex=regex)) for _, regex in STRUCTURED]
    params.append(greedy(40, structured_outputs=StructuredOutputs(choice=["abababab", "ababxyz"])))
    outputs, _ = compare(hf, prompts, params, spec=spec_for(method, hf))
    assert (max(dropped) > 0) if method == "draft" else not dropped
    for (_, regex), out in zip(STRUCTURED, outputs, strict=False):
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", (regex, out.text)
    # The choice ends inside what the prompt would propose: drafts past its end were trimmed.
    assert outputs[-1].text == "abababab" and outputs[-1].finish_reason == "stop"


def test_longest_allowed_trims_drafts_and_leaves_the_matcher_where_it_was():
    pytest.importorskip("xgrammar")
    from nanoserve.structured import GrammarCompiler

    compiler = GrammarCompiler(CharTokenizer(97), 97, frozenset({2}))
    grammar = compiler.matcher(compiler.compile(StructuredOutputs(regex="abc[0-9]")))
    a, b, c, x, seven = ids_of("abcx7")
    before = compiler.span_bitmask(grammar)
    assert grammar.longest_allowed([a, b, x, c]) == [a, b]
    assert grammar.longest_allowed([b]) == []
    assert grammar.longest_allowed([a, b, c, seven, seven]) == [a, b, c, seven]  # nothing after the end
    assert torch.equal(compiler.span_bitmask(grammar), before)  # no draft was taken
    # span_bitmask walks a request's drafts: row j's mask is what may follow drafts 0 .. j-1.
    masks = compiler.span_bitmask(grammar, [a, b])
    assert torch.equal(masks[0], before[0])
    for token, row in ((a, 0), (b, 1), (c, 2)):
        assert masks[row, token // 32] >> (token % 32) & 1, (token, row)
    assert not masks[0, b // 32] >> (b % 32) & 1 and not masks[2, a // 32] >> (a % 32) & 1
    assert torch.equal(compiler.span_bitmask(grammar), before)  # rolled back after the last row


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_n_completions_with_drafts(method):
    hf = tiny_model(lm_head_scale=10.0)
    params = [greedy(30, n=3), SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, n=3, seed=5)]
    spec_engine = engine(hf, spec_for(method, hf))
    grouped = spec_engine.generate([PROMPTS[0], PROMPTS[1]], params)
    check_pool(spec_engine)
    assert spec_engine.allocator.num_free == spec_engine.allocator.num_blocks
    plain = engine(hf, None).generate([PROMPTS[0], PROMPTS[1]], params)
    same_answers(grouped, plain)
    assert [o.index for o in grouped] == [0, 1, 2] * 2
    assert len({tuple(o.token_ids) for o in grouped[:3]}) == 1  # greedy copies agree
    assert len({tuple(o.token_ids) for o in grouped[3:]}) == 3  # seeds seed + i: each its own answer
    assert_speculated(grouped[:3])
    assert_speculated(grouped[3:])


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_preemption_with_drafts(method):
    hf = tiny_model()
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0][:10]]
    params = [greedy(36)] * 4
    spec_outputs, _ = drive(engine(hf, spec_for(method, hf), num_kv_blocks=30), prompts, params)
    plain_outputs, _ = drive(engine(hf, None), prompts, params)  # a pool that never preempts
    same_answers(spec_outputs, plain_outputs)
    assert sum(o.num_preemptions for o in spec_outputs) > 0
    assert_speculated(spec_outputs)


@needs_build
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("budget", [2, 5, 7])
def test_chunked_prefill_and_small_budgets(budget, method):
    hf = tiny_model()
    compare(hf, PROMPTS, [greedy(30)] * len(PROMPTS), spec=spec_for(method, hf), max_num_batched_tokens=budget)


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_prefix_cache_hits_blocks_computed_as_drafts(method):
    # The second prompt is the first one's prompt and answer and more: its hits reach into blocks
    # whose K/V were written by draft rows (and by rows after rejected drafts). A draft model
    # catches up on the hit blocks itself: its K/V there was written for the first request.
    hf = tiny_model()
    spec_engine = engine(hf, spec_for(method, hf), enable_prefix_caching=True)
    (first,), _ = drive(spec_engine, [PROMPTS[0]], [greedy(40)])
    assert_speculated([first])
    follow = PROMPTS[0] + list(first.token_ids) + [30, 31, 32]
    (second,), _ = drive(spec_engine, [follow], [greedy(30)])
    assert second.num_cached_tokens >= len(PROMPTS[0]) + 32
    (plain,), _ = drive(engine(hf, None, enable_prefix_caching=False), [follow], [greedy(30)])
    same_answers([second], [plain])


@needs_build
def test_deferred_output_is_not_deferred_with_speculation():
    hf = tiny_model()
    spec_engine = engine(hf, deferred_output=True)
    assert spec_engine.deferred is False and engine(hf, None, deferred_output=True).deferred is True
    compare(hf, PROMPTS, [greedy(30)] * len(PROMPTS), deferred_output=True)


@needs_build
@pytest.mark.parametrize("method", METHODS)
def test_abort_mid_run_gives_the_blocks_back(method):
    hf = tiny_model()
    spec_engine = engine(hf, spec_for(method, hf))
    ids = [spec_engine.add_request(p, greedy(40)) for p in PROMPTS[:3]]
    while spec_engine.requests[ids[1]].num_accepted_tokens == 0:
        spec_engine.step()
        check_pool(spec_engine)
    (aborted,) = spec_engine.abort(ids[1])
    assert aborted.finish_reason == "abort" and 0 < len(aborted.token_ids) < 40
    check_pool(spec_engine)
    finals = {}
    while spec_engine.has_unfinished():
        finals |= {o.request_id: o for o in spec_engine.step() if o.finished}
        check_pool(spec_engine)
    assert spec_engine.allocator.num_free == spec_engine.allocator.num_blocks
    (plain0, plain1, plain2), _ = drive(engine(hf, None), PROMPTS[:3], [greedy(40)] * 3)
    same_answers([finals[ids[0]], finals[ids[2]]], [plain0, plain2])
    assert list(aborted.token_ids) == list(plain1.token_ids)[:len(aborted.token_ids)]


@needs_build
def test_streams_through_async_engine():
    from nanoserve.serving.async_engine import AsyncEngine
    from nanoserve.serving.streaming import stream

    hf = tiny_model()
    plain, _ = drive(engine(hf, None), PROMPTS[:3], [greedy(30)] * 3)
    spec_engine = engine(hf)
    front = AsyncEngine(spec_engine)

    async def one(prompt):
        ids, text = [], ""
        async for delta in front.generate(prompt, greedy(30)):
            ids += delta.token_ids
            text += delta.text
        return ids, text

    async def main():
        results = await asyncio.gather(*(one(p) for p in PROMPTS[:3]))
        await front.shutdown()
        return results

    for (ids, text), want in zip(asyncio.run(main()), plain, strict=True):
        assert ids == list(want.token_ids) and text == want.text
    assert spec_engine.allocator.num_free == spec_engine.allocator.num_blocks
    deltas = list(stream(spec_engine, PROMPTS[0], greedy(30)))
    assert [t for d in deltas for t in d.token_ids] == list(plain[0].token_ids)
    assert max(len(d.token_ids) for d in deltas) > 1  # a delta carried several tokens: drafts kept
    assert spec_engine.requests == {}


# ---- tensor parallelism -----------------------------------------------------------------------------------


@needs_build
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("path", sorted(PATHS))
def test_tensor_parallel_ranks_verify_drafts_and_answer_the_same(method, path):
    # Two ranks on the batch-invariant plan (each rank's slices on panels, the C glue between them,
    # o and down summed in rank order), under preemption and 5-token chunks: with drafts verified
    # across both ranks, the answers are the same ranks' without speculation. A draft model runs on
    # rank 0 alone.
    from test_tensor_parallel import save_char_tokenizer

    hf = tiny_model(seed=43, head_dim=16)  # int4 reads groups of 32: a rank's 2 heads of 16 feed o
    checkpoint = saved(hf)
    save_char_tokenizer(checkpoint, hf.config.vocab_size)
    fields = {"tensor_parallel_size": 2, "tensor_parallel_timeout_s": 30.0, "num_kv_blocks": 28,
              "max_num_batched_tokens": 5}
    params = [greedy(36)] * len(PROMPTS)
    with Engine.from_pretrained(checkpoint, spec_config(spec_for(method, hf), path, **fields)) as spec_engine:
        assert spec_engine.plan.mixed == "c-tensor-parallel" and spec_engine.plan.is_batch_invariant
        spec_outputs, _ = drive(spec_engine, PROMPTS, params)
    with Engine.from_pretrained(checkpoint, spec_config(None, path, **fields)) as plain_engine:
        plain_outputs, _ = drive(plain_engine, PROMPTS, params)
    same_answers(spec_outputs, plain_outputs)
    assert_speculated(spec_outputs)
    assert sum(o.num_preemptions for o in spec_outputs) > 0


# ---- sampling: the target's distribution ----------------------------------------------------------------

SHARP = 40.0  # lm_head scale: the tiny model's next-token distribution puts ~1/3 on its top token
SAMPLING_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                 "max_step_rows": None}


def sharp_prompt(hf) -> list[int]:
    """A pattern and the model's own greedy continuation of it: what it samples next is, about a
    third of the time, what followed that token earlier in the prompt."""
    return continued(hf, [10, 11, 12, 13, 14, 15, 16, 17], 24)


def exact_distribution(hf, prompt: list[int], num_samples: int) -> tuple[dict, dict]:
    """transformers' exact P(t1, t2) and P(t1, t2, t3) after `prompt` at temperature 1, for the
    outcomes expected at least 5 times in num_samples (the rest is one bin in the test)."""
    def next_probs(prefixes):
        with torch.no_grad():
            return torch.softmax(hf(torch.tensor(prefixes)).logits[:, -1].double(), dim=-1)

    p1 = next_probs([prompt])[0]
    firsts = [a for a in range(p1.shape[0]) if num_samples * p1[a] >= 5]
    p2 = next_probs([prompt + [a] for a in firsts])
    pairs = {(a, b): float(p1[a] * p2[i, b]) for i, a in enumerate(firsts) for b in range(p2.shape[1])
             if num_samples * p1[a] * p2[i, b] >= 5}
    p3 = next_probs([prompt + list(ab) for ab in pairs])
    triples = {(*ab, c): pab * float(p3[j, c]) for j, (ab, pab) in enumerate(pairs.items())
               for c in range(p3.shape[1]) if num_samples * pab * p3[j, c] >= 5}
    return pairs, triples


def chi_square_z(counts: Counter, probs: dict, num_samples: int) -> float:
    """Pearson's statistic over the bins of `probs` and one bin for everything else, as a z-score
    (Wilson-Hilferty: (X / df)^(1/3) is near normal with mean 1 - 2 / (9 df))."""
    observed = [counts[key] for key in probs] + [num_samples - sum(counts[key] for key in probs)]
    expected = [num_samples * p for p in probs.values()] + [num_samples * (1.0 - sum(probs.values()))]
    assert expected[-1] >= 5
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(expected) - 1
    return ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))


def sampled_run(hf, prompt: list[int], num_samples: int) -> list:
    """num_samples seeded requests of the prompt at temperature 1, max_tokens 4, all at once."""
    sampler_engine = engine(hf, SAMPLING_SPEC, block_size=16, num_kv_blocks=400, max_num_seqs=64,
                            max_num_batched_tokens=2048)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(num_samples)]
    outputs = sampler_engine.generate([prompt] * num_samples, params)
    sampler_engine.check_invariants()
    assert sampler_engine.allocator.num_free == sampler_engine.allocator.num_blocks
    return outputs


def keep_every_draft(monkeypatch) -> None:
    """A wrong verifier: the output stage sees each draft row's token replaced by its draft."""
    process = OutputProcessor.process

    def always_accept(self, batch, rows):
        if rows.has_drafts:
            tokens = batch.tokens.clone()
            for span in rows.spans:
                for row, draft in zip(span.rows, span.drafts, strict=False):
                    tokens[row] = draft
            batch = TokenBatch(tokens, batch.request_ids, batch.readback, batch.logprobs)
        return process(self, batch, rows)

    monkeypatch.setattr(OutputProcessor, "process", always_accept)


@needs_build
def test_speculative_sampling_draws_from_the_targets_distribution(monkeypatch):
    # Each request samples t1 from its prompt; the next step verifies two drafts (the lookup of t1
    # in the prompt): its rows give t2 (verifying d1) and, if d1 was kept, t3 (verifying d2). The
    # empirical P(t1, t2) and P(t1, t2, t3) must match transformers' exact ones.
    num_samples = 6000
    hf = tiny_model(lm_head_scale=SHARP)
    prompt = sharp_prompt(hf)
    pairs, triples = exact_distribution(hf, prompt, num_samples)
    outputs = sampled_run(hf, prompt, num_samples)
    # Power: most requests verified drafts, and a fair share of them were kept.
    assert sum(o.num_draft_tokens > 0 for o in outputs) > 0.8 * num_samples
    drafted, accepted = sum(o.num_draft_tokens for o in outputs), sum(o.num_accepted_tokens for o in outputs)
    assert 0.15 < accepted / drafted < 0.6, (accepted, drafted)
    pair_counts = Counter(tuple(o.token_ids[:2]) for o in outputs)
    triple_counts = Counter(tuple(o.token_ids[:3]) for o in outputs)
    assert len(pairs) > 20 and len(triples) > 40
    assert chi_square_z(pair_counts, pairs, num_samples) < 4.0
    assert chi_square_z(triple_counts, triples, num_samples) < 4.0

    # The statistic sees a wrong verifier. Run: one that keeps every draft.
    with monkeypatch.context() as patch:
        keep_every_draft(patch)
        wrong = sampled_run(hf, prompt, num_samples)
    assert chi_square_z(Counter(tuple(o.token_ids[:2]) for o in wrong), pairs, num_samples) > 20.0
    # By hand: a subtler one, which keeps d with probability p(d) but on a rejection draws from the
    # whole p (d included), gives P(t2 = d | t1) = p(d) (2 - p(d)). Its expected statistic on the
    # pair bins (df plus the noncentrality) as a z-score:
    proposer = NgramProposer(1, 2)
    with torch.no_grad():
        firsts = sorted({a for a, _ in pairs})
        p2 = torch.softmax(hf(torch.tensor([prompt + [a] for a in firsts])).logits[:, -1].double(), dim=-1)
    skewed = {}
    for (a, b), p in pairs.items():
        draft = proposer.propose(prompt + [a], 2)
        p_draft = float(p2[firsts.index(a), draft[0]]) if draft else 0.0
        p_second = float(p2[firsts.index(a), b])
        p_first = p / p_second
        skewed[(a, b)] = p_first * (p_second * (1 - p_draft) + (p_draft if draft and b == draft[0] else 0.0))
    noncentrality = sum(num_samples * (skewed[k] - p) ** 2 / p for k, p in pairs.items())
    df = len(pairs)
    expected_stat = df + noncentrality
    z = ((expected_stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    assert z > 10.0, z


@needs_build
def test_a_seeded_request_samples_the_same_tokens_with_or_without_speculation_beside_anything():
    hf = tiny_model(lm_head_scale=SHARP)
    prompt = sharp_prompt(hf)
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1234)
    others = [PROMPTS[i] for i in (1, 2, 3, 4, 1)]
    other_params = [SamplingParams(temperature=0.8, max_tokens=30 + i, ignore_eos=True, seed=i) for i in range(5)]
    (plain,), _ = drive(engine(hf, None), [prompt], [params])
    (alone,), _ = drive(engine(hf), [prompt], [params])
    preempting, _ = drive(engine(hf, num_kv_blocks=32), others[:3] + [prompt], other_params[:3] + [params])
    assert sum(o.num_preemptions for o in preempting) > 0
    runs = {
        "alone": alone,
        # last admitted of six: max_step_rows (16) leaves it fewer drafts, or none
        "crowded": drive(engine(hf), others + [prompt], other_params + [params])[0][-1],
        "first of six": drive(engine(hf), [prompt] + others, [params] + other_params)[0][0],
        "budget 4": drive(engine(hf, max_num_batched_tokens=4), others[:2] + [prompt],
                          other_params[:2] + [params])[0][-1],
        "preempting pool": preempting[-1],
    }
    for name, out in runs.items():
        assert list(out.token_ids) == list(plain.token_ids), name
    assert_speculated(runs.values())
    assert len({o.num_draft_tokens for o in runs.values()}) > 1  # the compositions gave it different drafts


# ---- the default model ---------------------------------------------------------------------------------

EDIT_TEXT = ("The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all afternoon, and the fox "
             "runs back to the forest before dark.")
CHATS = [
    [{"role": "user", "content": f"Repeat this text exactly:\n\n{EDIT_TEXT}"}],
    [{"role": "user", "content": f"Rewrite this text with 'fox' replaced by 'cat':\n\n{EDIT_TEXT}"}],
    [{"role": "user", "content": "Copy this list and add a fourth item:\n1. apples\n2. bananas\n3. cherries"}],
    [{"role": "user", "content": "Fix the spelling: 'I recieved teh package yesterday and it was grate.'"}],
]


@pytest.mark.slow
@pytest.mark.weights
@needs_build
def test_the_default_model_answers_the_same_with_speculation(default_model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=64)
    answers = {}
    for spec in (None, SPEC):
        served = Engine.from_pretrained(default_model_dir, EngineConfig(speculative_config=spec))
        assert served.plan.is_batch_invariant, served.plan.render()
        answers[spec is not None] = served.chat(CHATS, params)
        served.check_invariants()
        assert served.allocator.num_free == served.allocator.num_blocks
        del served
    same_answers(answers[True], answers[False])
    assert sum(o.num_accepted_tokens for o in answers[True]) > 0.3 * sum(len(o.token_ids) for o in answers[True])
    assert_speculated(answers[True])


@pytest.mark.slow
@pytest.mark.weights
@needs_build
def test_the_dense_default_model_answers_the_same_with_its_gguf_as_draft(default_model_dir):
    # The target: the shipped file de-quantized (a dense checkpoint) in bf16; the draft: the file itself.
    from nanoserve.model.default import gguf_path

    fields = {"dtype": "bfloat16", "quantization": None, "batch_invariant": True}
    spec = {"method": "draft_model", "model": str(gguf_path()), "num_speculative_tokens": 4, "min_acceptance": 0.0}
    params = SamplingParams(temperature=0.0, max_tokens=48)
    answers = {}
    for speculative in (None, spec):
        served = Engine.from_pretrained(default_model_dir, EngineConfig(**fields, speculative_config=speculative))
        answers[speculative is not None] = served.chat(CHATS, params)
        assert served.allocator.num_free == served.allocator.num_blocks
        del served
    same_answers(answers[True], answers[False])
    # A quantized copy of the target drafts well: most of the output came as kept drafts.
    assert sum(o.num_accepted_tokens for o in answers[True]) > 0.5 * sum(len(o.token_ids) for o in answers[True])


def test_serve_takes_the_speculative_config_as_a_json_object():
    import argparse

    from nanoserve.serving.cli import speculative_config

    assert speculative_config('{"method": "ngram", "num_speculative_tokens": 3}') == {
        "method": "ngram", "num_speculative_tokens": 3}
    for bad in ('{"method": ngram}', '[1, 2]'):
        with pytest.raises(argparse.ArgumentTypeError):
            speculative_config(bad)
