"""A reasoning model's <think> block kept apart from its answer (`serve --reasoning-parser`).

References are written by hand: the splits of fixed texts, and, through a real server and the
official openai client, the text the same request gets from a server without the parser cut at its
tags by a regular expression here.
"""

from __future__ import annotations

import re

import pytest
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import error_of, running_server

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


def test_an_unknown_parser_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"'r2' is not one of \['qwen3', 'deepseek_r1'\]"):
        ServerConfig(reasoning_parser="r2")
    with pytest.raises(ValueError, match="not one of"):
        ReasoningSplitter("r2")


openai = pytest.importorskip("openai")
THINKING = r"<think>[a-z ]{4,16}</think>[a-z ]{2,10}"  # held by a grammar: the default model does not think


@pytest.fixture(scope="module")
def reasoning_client(default_model_dir, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("reasoning"), "--reasoning-parser", "qwen3") as s:
        yield openai.OpenAI(base_url=f"{s.base}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.weights
def test_the_server_returns_reasoning_content_apart_streamed_and_not(client, reasoning_client):
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Think, then answer: is ice cold?"}],
                   temperature=0, max_tokens=40, extra_body={"structured_outputs": {"regex": THINKING}})
    whole = client.chat.completions.create(**request).choices[0].message.content  # no parser: the raw text
    thought, answer = re.fullmatch(r"<think>(.*)</think>(.*)", whole, re.S).groups()
    got = reasoning_client.chat.completions.create(**request).choices[0].message
    assert (got.reasoning_content, got.content) == (thought, answer)
    chunks = list(reasoning_client.chat.completions.create(**request, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == answer
    assert deltas[0].role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"


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
