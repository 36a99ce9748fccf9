"""nanoserve/chat.py and Engine.chat: a conversation rendered by the tokenizer's chat template and
encoded with no special tokens added, one conversation or a list of them, refused with a
ValueError where there is no template to render it; on the default model, the ids the tokenizer's
own templating gives."""

from __future__ import annotations

import pytest
from conftest import CharTokenizer, greedy, make_tiny_engine

from nanoserve import Engine
from nanoserve.chat import as_conversations, encode_chat, render_chat

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"


class ChatTokenizer(CharTokenizer):
    """CharTokenizer with a chat template: each message as <role>content, then <a> for the reply.
    Encoding adds a BOS (1) unless told not to, as a Hugging Face tokenizer may."""

    chat_template = TEMPLATE

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False, **kwargs):
        assert tokenize is False  # nanoserve renders text, then encodes it itself
        if any(m["role"] not in ("system", "user", "assistant") for m in messages):
            raise RuntimeError(f"unknown role in {messages}")  # as a template's raise_exception does
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<a>" if add_generation_prompt else "") + kwargs.get("suffix", "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + super().encode(text)


HELLO = [{"role": "user", "content": "hi"}]
QUESTION = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}]


def chat_engine(**config) -> Engine:
    base = make_tiny_engine(**config)
    return Engine(base.model, ChatTokenizer(97), base.config)


def test_render_chat_opens_the_assistants_turn_and_passes_the_templates_arguments():
    tok = ChatTokenizer(97)
    assert render_chat(tok, QUESTION) == "<system>be brief<user>2+2?<a>"
    assert render_chat(tok, HELLO, add_generation_prompt=False, suffix="!") == "<user>hi!"


def test_encode_chat_adds_no_special_tokens():
    tok = ChatTokenizer(97)
    assert encode_chat(tok, "<a>") == tok.encode("<a>", add_special_tokens=False) == tok.encode("<a>")[1:]


@pytest.mark.parametrize("tokenizer, message", [
    (None, "a chat needs a tokenizer with a chat template; there is no tokenizer"),
    (CharTokenizer(97), r"the tokenizer \(CharTokenizer\) has no chat template"),
])
def test_render_chat_without_a_template_is_refused(tokenizer, message):
    with pytest.raises(ValueError, match=message):
        render_chat(tokenizer, HELLO)


def test_a_conversation_the_template_rejects_is_a_value_error():
    with pytest.raises(ValueError, match="the chat template rejected the messages: unknown role"):
        render_chat(ChatTokenizer(97), [{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="may not set tokenize"):
        render_chat(ChatTokenizer(97), HELLO, tokenize=True)


def test_as_conversations_takes_one_conversation_or_a_list():
    assert as_conversations(HELLO) == [HELLO]
    assert as_conversations([HELLO, QUESTION]) == [HELLO, QUESTION]
    assert as_conversations((HELLO[0],)) == [HELLO]


@pytest.mark.parametrize("messages, message", [
    ("hi", r"messages must be a conversation .* or a list of conversations; got str$"),
    (None, "got NoneType$"),
    ([], "messages is empty"),
    ([HELLO, []], "conversation 1 is empty"),
    (["hi"], "got a list holding str at index 0$"),
    ([HELLO, "hi"], "got a list holding str at index 1$"),
    ([[HELLO[0], "hi"]], "conversation 0 holds str at index 1$"),
])
def test_what_is_not_a_conversation_is_refused_naming_it(messages, message):
    with pytest.raises(ValueError, match=message):
        as_conversations(messages)


def test_engine_chat_runs_the_rendered_ids_as_generate_would():
    engine = chat_engine()
    tok = engine.tokenizer
    params = greedy(5)
    expected = make_tiny_engine().generate([tok.encode(render_chat(tok, c), add_special_tokens=False)
                                            for c in (HELLO, QUESTION)], params)
    outs = engine.chat([HELLO, QUESTION], params)
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in expected]
    assert outs[0].prompt_token_ids == CharTokenizer(97).encode("<user>hi<a>")  # no BOS of the encoder's
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    (one,) = engine.chat(HELLO, params)  # one conversation: one output
    assert one.token_ids == outs[0].token_ids


def test_engine_chat_takes_params_per_conversation_and_template_arguments():
    engine = chat_engine()
    outs = engine.chat([HELLO, QUESTION], [greedy(2), greedy(4)],
                       chat_template_kwargs={"add_generation_prompt": False})
    assert [len(o.token_ids) for o in outs] == [2, 4]
    assert outs[0].prompt_token_ids == CharTokenizer(97).encode("<user>hi")
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        engine.chat([HELLO, QUESTION], [greedy(2)])


@pytest.mark.parametrize("tokenizer, message", [
    (None, "there is no tokenizer"),
    (CharTokenizer(97), r"the tokenizer \(CharTokenizer\) has no chat template"),
])
def test_engine_chat_without_a_template_is_refused_and_leaves_nothing_behind(tokenizer, message):
    base = make_tiny_engine()
    engine = Engine(base.model, tokenizer, base.config)
    with pytest.raises(ValueError, match=message):
        engine.chat(HELLO, greedy(2))
    assert not engine.has_unfinished()


MESSAGES = [{"role": "user", "content": "What is 2 + 2? Answer with a number."}]


@pytest.mark.weights
def test_on_the_default_model_chat_prompts_are_the_tokenizers_own_templated_ids(default_engine):
    tok = default_engine.tokenizer
    (out,) = default_engine.chat(MESSAGES, greedy(2))
    assert out.prompt_token_ids == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=False)
    assert len(out.token_ids) == 2
    # The template's tokenized output is a BatchEncoding: refused at the door, naming it.
    with pytest.raises(ValueError, match=r"got BatchEncoding \(a mapping: pass its \['input_ids'\]\)"):
        default_engine.generate([tok.apply_chat_template(MESSAGES, add_generation_prompt=True)], greedy(2))
    assert not default_engine.has_unfinished()
