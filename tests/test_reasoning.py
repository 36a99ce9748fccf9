"""A reasoning model's <think> block: kept apart from its answer (`serve --reasoning-parser`), its
grammar applied after it and its length bounded (nanoserve.reasoning).

References are written by hand: the splits of fixed texts; in the engine, transformers' own model
greedy step by step with the tokens a step may take chosen here (any inside the block, the end
marker's once the budget is spent, the digits a regex allows after it); and, through a real server
and the official openai client, the text and tokens the same request gets from a server without
the parser (no grammar, no budget), cut at its tags by a regular expression here, and `json` /
`jsonschema` on the answers.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import CharTokenizer, error_of, make_hf_llama, make_tiny_engine, running_server

from nanoserve import SamplingParams
from nanoserve.model import blockdot
from nanoserve.params import StructuredOutputs
from nanoserve.reasoning import Phase, ReasoningGrammar
from nanoserve.serving.server.guard import ServerConfig
from nanoserve.serving.server.reasoning import ReasoningSplitter, split

CASES = [  # (parser, text, reasoning, answer), by hand
    ("qwen3", "<think>\nfirst, plan\n</think>\n\nThe answer.", "\nfirst, plan\n", "\n\nThe answer."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off while thinking", "cut off while thinking", ""),
    ("qwen3", "<thing> is not a tag", None, "<thing> is not a tag"),
    ("qwen3", "<think></think>only the answer", "", "only the answer"),
    ("qwen3", "<think>a < b, and </thin is not the end</think>x", "a < b, and </thin is not the end", "x"),
    ("deepseek_r1", "opened in the prompt</think>answer", "opened in the prompt", "answer"),
    ("deepseek_r1", "<think>opened here</think>answer", "opened here", "answer"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), CASES)
def test_a_whole_text_splits_at_its_tags(parser, text, reasoning, answer):
    assert split(parser, text) == (reasoning, answer)


@pytest.mark.parametrize(("parser", "text", "reasoning", "answer"), CASES)
def test_streamed_pieces_cut_anywhere_give_the_same_split(parser, text, reasoning, answer):
    # every cut into two pieces, and one character at a time: a tag split across pieces is held back
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        splitter = ReasoningSplitter(parser)
        got = [splitter.feed(piece) for piece in pieces] + [splitter.finish()]
        assert "".join(r for r, _ in got) == (reasoning or ""), pieces
        assert "".join(a for _, a in got) == answer, pieces


def test_a_prompt_that_opened_the_block_starts_the_output_inside_it():
    assert split("qwen3", "still thinking</think>answer", opened=True) == ("still thinking", "answer")
    assert split("qwen3", "no end yet", opened=True) == ("no end yet", "")


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"'r2' is not one of \['qwen3', 'deepseek_r1'\]"):
        ServerConfig(reasoning_parser="r2")
    with pytest.raises(ValueError, match="not one of"):
        ReasoningSplitter("r2")


# ---- the engine: the grammar after the block, the budget ---------------------------------------------

EOS = 2


def ids_of(text: str) -> list[int]:
    """CharTokenizer's ids for `text` as its decode reads them (its encode is not decode's inverse)."""
    ids = [3 + ord(c) - 32 for c in text]
    assert CharTokenizer(97).decode(ids) == text
    return ids


END, START = tuple(ids_of("</think>")), tuple(ids_of("<think>"))
DIGIT_IDS = ids_of("0123456789")
DIGITS = StructuredOutputs(regex="[0-9]{3}")


def reference(prompt: list[int], plan: list) -> tuple[list[int], list[float]]:
    """transformers' greedy over the tiny engine's model, one step per entry of `plan`: None takes
    the argmax of all tokens, an int is that token (forced), a list the argmax among those ids.
    Returns the tokens and each one's log-probability under the model's whole distribution."""
    hf = make_hf_llama(0)
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for step in plan:
            logits = hf(torch.tensor([ids])).logits[0, -1]
            if step is None:
                token = int(logits.argmax())
            elif isinstance(step, int):
                token = step
            else:
                allowed = torch.tensor(step)
                token = int(allowed[logits[allowed].argmax()])
            ids.append(token)
            logprobs.append(float(torch.log_softmax(logits.double(), -1)[token]))
    return ids[len(prompt):], logprobs


pytest.importorskip("xgrammar")


@pytest.mark.parametrize("deferred", [False, True])
def test_the_budget_forces_the_end_and_the_grammar_applies_after_it(deferred):
    prompt = ids_of("Q? <think>")  # the prompt opened the block: the output starts inside it
    budget = 5
    params = SamplingParams(temperature=0.0, max_tokens=30, logprobs=1, structured_outputs=DIGITS,
                            reasoning_end_token_ids=END, max_reasoning_tokens=budget)
    out = make_tiny_engine(deferred_output=deferred).generate([prompt], params)[0]
    want, logprobs = reference(prompt, [None] * budget + list(END) + [DIGIT_IDS] * 3 + [EOS])
    assert out.token_ids == want and out.finish_reason == "stop"
    thought, answer = CharTokenizer(97).decode(want[:budget]), CharTokenizer(97).decode(want[budget + len(END):])
    assert out.text == thought + "</think>" + answer and re.fullmatch("[0-9]{3}", answer)
    assert not re.fullmatch("[0-9]*", thought)  # the block is not held to the grammar
    # every token, forced or not, reports the model's own logprob for it (read before the mask)
    assert [entry[token] for entry, token in zip(out.logprobs, out.token_ids, strict=True)] == \
        pytest.approx(logprobs, abs=1e-4)


def test_the_model_ending_the_block_itself_starts_the_grammar():
    prompt = ids_of("Q? <think>")
    free, _ = reference(prompt, [None] * 12)
    # the end marker: a token the model writes on its own, the first one not seen before it
    k = next(i for i, t in enumerate(free) if t not in free[:i] and i >= 2)
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=DIGITS,
                            reasoning_end_token_ids=(free[k],))
    out = make_tiny_engine().generate([prompt], params)[0]
    want, _ = reference(prompt, [None] * (k + 1) + [DIGIT_IDS] * 3 + [EOS])
    assert want[:k + 1] == free[:k + 1] and out.token_ids == want


def test_an_output_may_open_the_block_under_a_grammar_or_answer_at_once():
    prompt = ids_of("Q? ")  # nothing opened: the first token opens the block or begins the answer
    first = reference(prompt, [None])[0][0]
    x, y = ids_of("xy")
    start = (first, x, y)  # a marker whose first token the model prefers to every digit
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=DIGITS, reasoning_start_token_ids=start,
                            reasoning_end_token_ids=END, max_reasoning_tokens=3)
    engine = make_tiny_engine()
    out = engine.generate([prompt], params)[0]
    # a started marker is finished (x, y forced), then 3 free tokens, the end forced, the digits
    want, _ = reference(prompt, list(start) + [None] * 3 + list(END) + [DIGIT_IDS] * 3 + [EOS])
    assert out.token_ids == want
    # a marker the model likes least at the first step: the grammar's digits win it, and the
    # whole output is the answer, as if there were no block (no budget forces anything)
    hf = make_hf_llama(0)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, -1]
    least = min((t for t in range(3, 97) if t not in DIGIT_IDS), key=lambda t: float(logits[t]))
    params = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=DIGITS, reasoning_start_token_ids=(least,),
                            reasoning_end_token_ids=END, max_reasoning_tokens=0)
    out = engine.generate([prompt], params)[0]
    want, _ = reference(prompt, [DIGIT_IDS + [least]] + [DIGIT_IDS] * 2 + [EOS])
    assert out.token_ids == want and re.fullmatch("[0-9]{3}", out.text)


def test_budget_zero_ends_the_block_at_once_and_a_budget_alone_needs_no_grammar():
    prompt = ids_of("Q? <think>")
    engine = make_tiny_engine()
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   reasoning_end_token_ids=END, max_reasoning_tokens=0))[0]
    want, _ = reference(prompt, list(END) + [None] * 4)
    assert out.token_ids == want
    # no limit: the same request is the model's own greedy run
    out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                   reasoning_end_token_ids=END, max_reasoning_tokens=-1))[0]
    assert out.token_ids == reference(prompt, [None] * 12)[0]


def test_drafts_are_trimmed_and_rolled_back_across_the_end_of_the_block():
    engine = make_tiny_engine()
    params = SamplingParams(reasoning_end_token_ids=END, max_reasoning_tokens=0, structured_outputs=DIGITS)
    gate = ReasoningGrammar(params, ids_of("<think>"), engine.grammars.matcher(engine.grammars.compile(DIGITS)))
    assert gate.phase is Phase.FORCING
    before = engine.grammars.span_bitmask(gate)
    # one bit set in the row: END[0]'s
    assert sum(bin(w & 0xFFFFFFFF).count("1") for w in before[0].tolist()) == 1
    assert int(before[0, END[0] // 32]) >> (END[0] % 32) & 1
    one, two, x = ids_of("12x")
    assert gate.longest_allowed([*END, one, two, x]) == [*END, one, two]
    assert gate.longest_allowed([one]) == []  # inside the block the forced marker comes first
    assert gate.phase is Phase.FORCING and torch.equal(engine.grammars.span_bitmask(gate), before)
    for token in [*END, one, two]:
        assert not gate.accept(token)
    assert gate.phase is Phase.ANSWER and gate.accept(one) is False and gate.accept(EOS) is True


@pytest.mark.skipif(blockdot.library() is None, reason="blockdot not built here: speculation's plan needs it")
def test_speculative_drafts_give_the_same_tokens_through_the_block_and_after_it():
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "min_acceptance": 0.0}
    prompts = [ids_of("abcabcabc <think>abcabc"), ids_of("xyxyxyxy <think>"), ids_of("ok ")]
    params = [SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputs(regex="(ab|c)+[0-9]"),
                             reasoning_end_token_ids=END, max_reasoning_tokens=budget, reasoning_start_token_ids=START)
              for budget in (9, 0, 4)]
    plain = make_tiny_engine(batch_invariant=True).generate(prompts, params)  # speculation's plan, as in test_speculative
    drafted = make_tiny_engine(batch_invariant=True, speculative_config=spec).generate(prompts, params)
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert sum(o.num_draft_tokens for o in drafted) > 0 and sum(o.num_accepted_tokens for o in drafted) > 0
    assert all(re.fullmatch(r"(ab|c)+[0-9]", o.text.rpartition("</think>")[2]) for o in drafted)


@pytest.mark.parametrize(("fields", "message"), [
    ({"max_reasoning_tokens": -2}, r"max_reasoning_tokens=-2 must be -1"),
    ({"max_reasoning_tokens": 1.5}, r"max_reasoning_tokens=1.5 must be -1"),
    ({"max_reasoning_tokens": True}, r"max_reasoning_tokens=True must be -1"),
    ({"max_reasoning_tokens": "3"}, r"max_reasoning_tokens='3' must be -1"),
    ({"max_reasoning_tokens": 3, "reasoning_end_token_ids": ()}, r"max_reasoning_tokens=3 needs reasoning_end_token_ids"),
    ({"reasoning_start_token_ids": (4,), "reasoning_end_token_ids": ()}, r"reasoning_start_token_ids=\(4,\) needs"),
    ({"reasoning_end_token_ids": "</think>"}, r"reasoning_end_token_ids='</think>' must be a sequence of token ids"),
    ({"reasoning_end_token_ids": (5, -1)}, r"reasoning_end_token_ids=\(5, -1\) must be"),
])
def test_bad_reasoning_params_are_refused_naming_the_value(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**({"reasoning_end_token_ids": END} | fields))


def test_unlimited_is_none_and_marker_ids_outside_the_vocabulary_are_refused():
    assert SamplingParams(reasoning_end_token_ids=END, max_reasoning_tokens=-1).max_reasoning_tokens is None
    with pytest.raises(ValueError, match=r"reasoning_end_token_ids=\(5, 500\): token id 500 is outside the vocabulary"):
        make_tiny_engine().add_request([5, 6], SamplingParams(reasoning_end_token_ids=(5, 500), max_reasoning_tokens=2))
    with pytest.raises(ValueError, match="reasoning_budget=-3 must be -1"):
        ServerConfig(reasoning_parser="qwen3", reasoning_budget=-3)
    with pytest.raises(ValueError, match="reasoning_budget=4 needs a reasoning parser"):
        ServerConfig(reasoning_budget=4)


@pytest.mark.parametrize(("flags", "message"), [
    (["--reasoning-parser", "qwen3", "--reasoning-budget", "-2"], "reasoning_budget=-2 must be -1 (no limit) or"),
    (["--reasoning-parser", "qwen3", "--reasoning-budget", "1.5"], "argument --reasoning-budget: invalid int value: '1.5'"),
    (["--reasoning-budget", "3"], "reasoning_budget=3 needs a reasoning parser (--reasoning-parser)"),
])
def test_serve_refuses_a_bad_budget_before_loading_anything(capsys, flags, message):
    from nanoserve.serving.cli import serve_main

    with pytest.raises(SystemExit) as exit_info:
        serve_main(flags)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ---- the server --------------------------------------------------------------------------------------

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
# Earlier turns that think first: the default model, which does not think on its own, then opens a
# block too (its tokenizer writes each tag as three tokens: "<", "think", ">" and "</", "think", ">").
SHOTS = [{"role": "user", "content": "Is fire hot?"},
         {"role": "assistant", "content": '<think>fire burns, so yes</think>{"answer": "yes"}'},
         {"role": "user", "content": "Is snow green?"},
         {"role": "assistant", "content": '<think>snow is white, so no</think>{"answer": "no"}'},
         {"role": "user", "content": "Is ice cold?"}]
COLD = {"type": "object", "properties": {"cold": {"type": "boolean"}}, "required": ["cold"],
        "additionalProperties": False}
AS_COLD = {"type": "json_schema", "json_schema": {"name": "cold", "schema": COLD}}
BUDGET = 3  # the reasoning server's --reasoning-budget


@pytest.fixture(scope="module")
def reasoning_client(default_model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "qwen3",
                        "--reasoning-budget", str(BUDGET)) as s:
        yield openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=120)


def ask(client, **fields):
    return client.chat.completions.create(**({"model": MODEL, "messages": SHOTS, "temperature": 0, "max_tokens": 40}
                                             | fields))


def streamed(client, **fields) -> tuple[str, str, list]:
    """A streamed request's (reasoning, content) joined from its deltas, and its chunks."""
    chunks = list(ask(client, stream=True, **fields))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    return ("".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas), chunks)


@pytest.mark.weights
def test_the_answer_after_the_block_is_held_to_the_schema_and_the_block_is_not(client, reasoning_client):
    whole = ask(client).choices[0].message.content  # no parser, no grammar, no budget: the model's own text
    thought, own_answer = re.fullmatch(r"<think>(.*)</think>(.*)", whole, re.S).groups()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(own_answer), COLD)  # left alone, the model answers otherwise
    request = {"response_format": AS_COLD, "extra_body": {"max_reasoning_tokens": -1}}  # no limit: its own end
    got = ask(reasoning_client, **request).choices[0].message
    assert got.reasoning_content == thought
    jsonschema.validate(json.loads(got.content), COLD)
    reasoning, content, chunks = streamed(reasoning_client, **request)
    assert (reasoning, content) == (got.reasoning_content, got.content)
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.weights
def test_the_budget_ends_the_block_after_exactly_its_tokens(client, reasoning_client):
    n = BUDGET
    own = ask(client, max_tokens=3 + n, logprobs=True).choices[0].logprobs.content  # "<think>" and n more
    own_tokens = [t.token for t in own]
    got = ask(reasoning_client, response_format=AS_COLD, logprobs=True, top_logprobs=1)  # the server's budget
    entries = got.choices[0].logprobs.content
    tokens = [t.token for t in entries]
    assert "".join(tokens[:3]) == "<think>" and tokens[:3 + n] == own_tokens
    assert tokens[3 + n:6 + n] == ["</", "think", ">"]  # forced, right after n tokens in the block
    message = got.choices[0].message
    assert message.reasoning_content == "".join(own_tokens[3:])
    jsonschema.validate(json.loads(message.content), COLD)
    assert "".join(tokens[6 + n:]).startswith(message.content) and got.usage.completion_tokens == len(tokens)
    # a forced token reports the model's own logprob for it, below that of the token it preferred
    forced = entries[3 + n]
    assert forced.top_logprobs[0].token != "</" and forced.logprob < forced.top_logprobs[0].logprob
    reasoning, content, _ = streamed(reasoning_client, response_format=AS_COLD)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    # a request's own budget: 0 ends the block as soon as it opens
    got = ask(reasoning_client, response_format=AS_COLD, logprobs=True, extra_body={"max_reasoning_tokens": 0})
    assert [t.token for t in got.choices[0].logprobs.content][:6] == ["<", "think", ">", "</", "think", ">"]
    assert got.choices[0].message.reasoning_content == ""
    jsonschema.validate(json.loads(got.choices[0].message.content), COLD)


@pytest.mark.weights
def test_a_tool_call_grammar_applies_after_the_block(reasoning_client):
    tool = {"type": "function", "function": {"name": "report", "parameters": COLD}}
    got = ask(reasoning_client, tools=[tool], tool_choice={"type": "function", "function": {"name": "report"}})
    message = got.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["report"]
    jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), COLD)
    assert message.reasoning_content is not None and len(message.reasoning_content) > 0


@pytest.mark.weights
def test_offline_the_default_models_tokenizer_gives_the_markers_and_the_budget_counts_tokens(default_engine):
    engine, n = default_engine, 4
    tokenizer = engine.tokenizer
    start, end = (tuple(tokenizer.encode(t, add_special_tokens=False)) for t in ("<think>", "</think>"))
    own = engine.chat(SHOTS, SamplingParams(temperature=0.0, max_tokens=len(start) + n))[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=40, reasoning_start_token_ids=start, reasoning_end_token_ids=end,
                            max_reasoning_tokens=n, structured_outputs=StructuredOutputs(json=COLD))
    out = engine.chat(SHOTS, params)[0]
    ids = list(out.token_ids)
    assert ids[:len(start) + n] == list(own) and tuple(ids[:len(start)]) == start  # the model opened the block
    assert tuple(ids[len(start) + n:len(start) + n + len(end)]) == end  # n tokens in it, then the forced end
    thought, _, answer = out.text.partition("</think>")
    assert thought == tokenizer.decode(own) and out.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), COLD)


@pytest.mark.weights
@pytest.mark.parametrize("value", [-2, 1.5, "3", True])
def test_a_bad_budget_is_refused_naming_it(reasoning_client, value):
    with pytest.raises(openai.BadRequestError) as raised:
        ask(reasoning_client, max_tokens=4, extra_body={"max_reasoning_tokens": value})
    assert error_of(raised.value)["param"] == "max_reasoning_tokens"


@pytest.mark.weights
def test_a_budget_without_a_reasoning_parser_is_refused(client):
    with pytest.raises(openai.BadRequestError) as raised:
        ask(client, max_tokens=4, extra_body={"max_reasoning_tokens": 3})
    assert error_of(raised.value)["param"] == "max_reasoning_tokens"
    assert "needs a server started with --reasoning-parser" in error_of(raised.value)["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, extra_body={"max_reasoning_tokens": 3})
    assert error_of(raised.value)["param"] == "max_reasoning_tokens"


@pytest.mark.weights
def test_chat_template_kwargs_reach_the_template_and_the_servers_own_are_refused(reasoning_client):
    messages = [{"role": "user", "content": "Hi"}]
    got = reasoning_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert got.choices[0].message.reasoning_content is None  # the default model never opens a think block
    with pytest.raises(openai.BadRequestError) as raised:
        reasoning_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                 extra_body={"chat_template_kwargs": {"tools": []}})
    assert error_of(raised.value)["param"] == "chat_template_kwargs"
