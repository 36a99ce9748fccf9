"""Structured outputs in the engine: the grammar's bitmask forces the tokens, other rows are untouched.

References are independent of nanoserve.structured: transformers' own model greedy over a mask
built by hand from the tokenizer's characters, Python's `re` and `jsonschema` on the outputs, and
bit arithmetic done in a loop.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import (
    PERSON_SCHEMA,
    CharTokenizer,
    greedy,
    make_hf_llama,
    make_tiny_engine,
    nanoserve_model_from_hf,
)

from nanoserve import Engine, EngineConfig, SamplingParams
from nanoserve.params import StructuredOutputs
from nanoserve.request import Request
from nanoserve.step_rows import StepRows
from nanoserve.structured import apply_bitmask, mask_logits

pytest.importorskip("xgrammar")

EOS = 2
PROMPT = [5, 6, 7, 8]
DIGITS = StructuredOutputs(regex="[0-9]{5}")


def char_ids(tokenizer: CharTokenizer, chars: str) -> list[int]:
    """Every id whose one character is in `chars`, by decoding each id (not by the code under test)."""
    return [i for i in range(3, tokenizer.vocab_size) if tokenizer.decode([i]) in chars]


def test_regex_forces_digits_as_masked_greedy_reference():
    engine = make_tiny_engine()
    out = engine.generate([PROMPT], greedy(12, structured_outputs=DIGITS))[0]
    # transformers' greedy, restricted by hand to the ids that decode to a digit, then EOS forced
    hf = make_hf_llama(0)
    digits = torch.tensor(char_ids(engine.tokenizer, "0123456789"))
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(5):
            logits = hf(torch.tensor([ids])).logits[0, -1]
            ids.append(int(digits[logits[digits].argmax()]))
    assert out.token_ids == ids[len(PROMPT):] + [EOS]
    assert re.fullmatch(r"[0-9]{5}", out.text) and out.finish_reason == "stop"
    unconstrained = engine.generate([PROMPT], greedy(5))[0]
    assert unconstrained.token_ids != out.token_ids[:5]  # the mask is what made them digits
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("deferred", [False, True])
def test_unconstrained_rows_are_token_identical_beside_constrained_ones(deferred):
    plain = [greedy(10), SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10, ignore_eos=True)]
    prompts = [PROMPT, [9, 10, 11]]
    alone = make_tiny_engine(deferred_output=deferred).generate(prompts, plain)
    engine = make_tiny_engine(deferred_output=deferred)
    mixed = engine.generate(prompts + [PROMPT, [12, 13]],
                            plain + [greedy(12, structured_outputs=DIGITS),
                                     greedy(12, structured_outputs=StructuredOutputs(choice=["yes", "no"]))])
    assert [o.token_ids for o in mixed[:2]] == [o.token_ids for o in alone]
    assert re.fullmatch(r"[0-9]{5}", mixed[2].text) and mixed[3].text in ("yes", "no")
    assert [o.finish_reason for o in mixed] == ["length", "length", "stop", "stop"]
    engine.check_invariants()
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_deferred_and_synchronous_loops_give_the_same_constrained_tokens():
    params = [greedy(12, structured_outputs=DIGITS), greedy(12, structured_outputs=StructuredOutputs(
        grammar='root ::= ("ab" | "cd") " " [0-9] [0-9]'))]
    sync = make_tiny_engine().generate([PROMPT, PROMPT], params)
    deferred = make_tiny_engine(deferred_output=True).generate([PROMPT, PROMPT], params)
    assert [o.token_ids for o in sync] == [o.token_ids for o in deferred]
    assert re.fullmatch(r"(ab|cd) [0-9][0-9]", sync[1].text)


@pytest.mark.parametrize("spec, field", [
    (StructuredOutputs(json={"type": "foo"}), "json"),
    (StructuredOutputs(regex="[0-9"), "regex"),
    (StructuredOutputs(grammar="root ::= "), "grammar"),
])
def test_a_grammar_that_does_not_compile_is_a_value_error_and_the_engine_keeps_serving(spec, field):
    engine = make_tiny_engine()
    with pytest.raises(ValueError, match=rf"^{field}=.* does not compile: "):
        engine.add_request(PROMPT, greedy(5, structured_outputs=spec))
    assert not engine.has_unfinished() and not engine.requests
    out = engine.generate([PROMPT], greedy(5, structured_outputs=DIGITS))[0]
    assert re.fullmatch(r"[0-9]{5}", out.text)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_bitmask_is_as_wide_as_the_logits_when_the_tokenizer_is_smaller():
    hf = make_hf_llama(0)  # 97 logits
    tokenizer = CharTokenizer(50)  # ids 0..49
    engine = Engine(nanoserve_model_from_hf(hf), tokenizer,
                    EngineConfig(block_size=4, num_kv_blocks=64, dtype="float32", quantization=None))
    compiled = engine.grammars.compile(StructuredOutputs(regex="[ -~]+"))  # any printable text
    free, constrained = (Request(str(i), [5], SamplingParams(), frozenset()) for i in range(2))
    constrained.grammar = engine.grammars.matcher(compiled)
    bitmask = engine.grammars.fill_bitmask(StepRows.one_each([free, constrained]))
    assert bitmask.shape == (2, 4) and bitmask.dtype == torch.int32  # ceil(97 / 32) words per row
    bits = [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(97)] for r in range(2)]
    printable = set(char_ids(tokenizer, "".join(map(chr, range(32, 127)))))
    assert bits[0] == [1] * 97  # an unconstrained row allows everything
    assert bits[1] == [int(t in printable) for t in range(97)]  # nothing past the tokenizer's 50
    out = engine.generate([PROMPT], greedy(8, structured_outputs=StructuredOutputs(regex="[ -~]+")))[0]
    assert all(t in printable for t in out.token_ids)


def apply_as_off_cpu(logits, bitmask):  # float64 logits: the lookup table is built per device and dtype
    return apply_bitmask(logits.double(), bitmask).float()


@pytest.mark.parametrize("apply", [apply_bitmask, mask_logits, apply_as_off_cpu])  # some rows, all rows, float64
def test_masking_matches_bit_arithmetic(apply):
    torch.manual_seed(0)
    logits = torch.randn(4, 70)
    bitmask = torch.randint(-2**31, 2**31 - 1, (4, 3), dtype=torch.int32)
    bitmask[2] = -1  # an unconstrained row
    masked = apply(logits, bitmask)
    for r in range(4):
        for t in range(70):
            allowed = (int(bitmask[r, t // 32]) >> (t % 32)) & 1
            assert masked[r, t].item() == (logits[r, t].item() if allowed else float("-inf"))
    assert masked.data_ptr() != logits.data_ptr()  # a copy: the logprobs read the model's own


def test_each_completion_of_n_has_its_own_matcher():
    engine = make_tiny_engine()
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=12, structured_outputs=DIGITS)
    rid = engine.add_request(PROMPT, params)
    grammars = {engine.requests[f"{rid}.{i}"].grammar for i in range(3)}
    assert len(grammars) == 3 and None not in grammars
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert len(outs) == 3 and all(re.fullmatch(r"[0-9]{5}", o.text) for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) > 1  # sampled apart, each copy still in the grammar


def test_preempted_constrained_requests_resume_in_their_grammar():
    params = greedy(12, structured_outputs=DIGITS)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(4)]
    roomy = make_tiny_engine().generate(prompts, params)
    engine = make_tiny_engine(num_kv_blocks=8, max_num_seqs=4)  # 4 requests need 12 blocks at full length
    tight = engine.generate(prompts, params)
    assert sum(o.num_preemptions for o in tight) > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in roomy]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_abort_releases_the_matcher_and_the_blocks():
    engine = make_tiny_engine()
    rid = engine.add_request(PROMPT, greedy(12, structured_outputs=DIGITS))
    request = engine.requests[rid]
    engine.step()
    [out] = engine.abort(rid)
    assert out.finish_reason == "abort" and request.grammar is None
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_compiled_grammars_are_cached_by_text_least_recently_used_first():
    engine = make_tiny_engine()
    grammars = engine.grammars
    grammars.max_cached = 2
    a, b, c = (StructuredOutputs(regex=r) for r in ("[0-9]+", "[a-f]+", "x+"))
    first = grammars.compile(a)
    assert grammars.compile(StructuredOutputs(regex="[0-9]+")) is first and grammars.num_compiled == 1
    grammars.compile(b)
    grammars.compile(a)  # a is now the most recent: c evicts b
    grammars.compile(c)
    assert list(grammars.cache) == [a, c] and grammars.num_compiled == 3


def test_an_engine_without_constrained_rows_builds_no_mask(monkeypatch):
    engine = make_tiny_engine()

    def forbidden(*args):
        raise AssertionError("a bitmask was built for a step with no constrained row")

    monkeypatch.setattr(engine.grammars, "fill_bitmask", forbidden)
    engine.generate([PROMPT, PROMPT], [greedy(6), SamplingParams(temperature=1.0, seed=1, max_tokens=6)])
    assert engine.grammars._compiler is None  # xgrammar was never even set up


def test_structured_outputs_validation():
    assert StructuredOutputs(json='{"type": "object",  "properties": {}}').json == '{"type":"object","properties":{}}'
    assert StructuredOutputs(json={"b": 1, "a": 2}).json == '{"b":1,"a":2}'  # key order is generation order
    assert hash(SamplingParams(structured_outputs=StructuredOutputs(choice=["a", "b"]))) is not None
    for kwargs, message in [({}, "exactly one"), ({"regex": "a", "json_object": True}, "exactly one"),
                            ({"json": "{not json"}, "json="), ({"json": [1]}, "json="),
                            ({"choice": []}, "choice="), ({"regex": ""}, "regex=")]:
        with pytest.raises(ValueError, match=message):
            StructuredOutputs(**kwargs)
    with pytest.raises(ValueError, match="structured_outputs="):
        SamplingParams(structured_outputs={"regex": "a"})


# ---- the real default model ------------------------------------------------------------------------


@pytest.mark.weights
def test_json_schema_output_of_the_default_model_parses_and_validates(default_model_dir):
    jsonschema = pytest.importorskip("jsonschema")
    engine = Engine.from_pretrained(default_model_dir, EngineConfig(dtype="float32", quantization=None, num_kv_blocks=64))
    messages = [{"role": "user", "content": "Describe a person named Anna who lives in Paris and has two pets, as JSON."}]
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    out = engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=160,
                                                structured_outputs=StructuredOutputs(json=PERSON_SCHEMA)))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)
    assert engine.allocator.num_free == engine.allocator.num_blocks
