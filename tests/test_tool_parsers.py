"""Tool-call parsing and planning without a model: each parser on hand-written outputs, fed whole
and in small pieces (the pieces must add up to the same calls), and the 400s tools.plan gives."""

from __future__ import annotations

import json

import pytest

from nanoserve.serving.server import tools
from nanoserve.serving.server.protocol import ApiError, ChatCompletionRequest
from nanoserve.serving.server.tool_parsers import CallArray, Content, Hermes, Llama3Json, NamedCall

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def fed(parser, text: str, piece: int) -> tuple[str, list[tuple[str, dict]]]:
    """Feeds text `piece` characters at a time; returns the content and the (name, arguments) calls."""
    events = [e for i in range(0, len(text), piece) for e in parser.feed(text[i:i + piece])] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    return content, [(name, json.loads(arguments)) for _, name, arguments in parser.calls]


@pytest.mark.parametrize("piece", [1, 2, 7, 10_000])
def test_call_array_streams_each_call_whatever_the_key_order(piece):
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"a": "]"}]}}, '
            '{"parameters": {}, "name": "get_time"}]')
    assert fed(CallArray(), text, piece) == ("", [("get_weather", {"city": 'Pa"ris}', "days": [1, {"a": "]"}]}),
                                                  ("get_time", {})])


@pytest.mark.parametrize("piece", [1, 3, 10_000])
def test_hermes_blocks_among_text(piece):
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> a < b <tool')
    content, calls = fed(Hermes(), text, piece)
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert content == "Let me check.\n\n a < b <tool"  # a held-back partial tag comes out at the end


def test_hermes_block_that_is_not_a_call_stays_text():
    assert fed(Hermes(), "<tool_call>not json</tool_call>", 4) == ("<tool_call>not json</tool_call>", [])


@pytest.mark.parametrize("piece", [1, 5, 10_000])
def test_llama3_json_calls_and_plain_text(piece):
    text = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    assert fed(Llama3Json(), text, piece) == ("", [("get_weather", {"city": "Paris"}), ("get_time", {})])
    assert fed(Llama3Json(), "The weather is {nice}.", piece) == ("The weather is {nice}.", [])
    assert fed(Llama3Json(), '{"not": "a call"}', piece) == ('{"not": "a call"}', [])


def test_named_call_is_the_whole_output():
    assert fed(NamedCall("get_weather"), '{"city": "Paris"}', 3) == ("", [("get_weather", {"city": "Paris"})])


def test_parser_for_template():
    assert tools.parser_for_template("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert tools.parser_for_template("{{- '<|python_tag|>' + tool_call.name }}") == "llama3_json"
    assert tools.parser_for_template("{% for message in messages %}{{ message['content'] }}{% endfor %}") is None


def test_streamed_deltas_assemble_to_the_message():
    plan = tools.ToolPlan("required", [WEATHER, TIME])
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    stream = tools.ToolDeltas(plan)
    assembled: dict[int, dict] = {}
    reasons = []
    for i in range(0, len(text), 4):
        last = i + 4 >= len(text)
        delta, reason = stream.delta(text[i:i + 4], last, "stop" if last else None)
        reasons.append(reason)
        for call in delta.get("tool_calls", []):
            entry = assembled.setdefault(call["index"], {"name": "", "arguments": ""})
            entry["name"] += call["function"].get("name", "")
            entry["arguments"] += call["function"]["arguments"]
    message, reason = tools.message(plan, text, "stop")
    assert reason == reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [(a["name"], a["arguments"]) for _, a in sorted(assembled.items())]
    assert message["content"] is None


def test_a_call_cut_short_is_left_out_of_the_message():
    plan = tools.ToolPlan("required", [WEATHER])
    message, reason = tools.message(plan, '[{"name": "get_weather", "parameters": {"city": "Pa', "length")
    assert message == {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Pa'}
    assert reason == "length"


class Template:
    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}]} | fields)


def test_plan_reads_the_choice_and_builds_vllms_schemas():
    plain = Template("{{ messages }}")
    named = tools.plan(body(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       plain)
    assert named.choice == "named" and json.loads(named.structured_outputs.json) == WEATHER["function"]["parameters"]
    required = tools.plan(body(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False), plain)
    assert json.loads(required.structured_outputs.json) == {
        "type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]},
                                              "parameters": WEATHER["function"]["parameters"]},
             "required": ["name", "parameters"]},
            {"type": "object", "properties": {"name": {"type": "string", "enum": ["get_time"]},
                                              "parameters": {"type": "object", "properties": {}}},
             "required": ["name", "parameters"]}]}}
    assert tools.plan(body(), plain).choice == "none"
    assert tools.plan(body(tools=[WEATHER]), Template("<tool_call>{{ tools }}")).parser == "hermes"


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto by default, and the template has no parser
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_plan_refusals_name_the_field(fields, param):
    with pytest.raises(ApiError) as raised:
        tools.plan(body(**fields), Template("{{ messages }}"))
    assert raised.value.status_code == 400 and raised.value.param == param


def test_tools_go_into_a_system_message_when_the_template_ignores_them():
    class Recorder(Template):
        def apply_chat_template(self, messages, **kwargs):
            self.messages, self.kwargs = messages, kwargs
            return "prompt"

    tokenizer = Recorder("{{ messages }}")
    history = [{"role": "user", "content": "weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    plan = tools.plan(body(tools=[WEATHER], tool_choice="required"), tokenizer)
    tools.render_prompt(tokenizer, history, plan)
    system, user, assistant, tool = tokenizer.messages
    assert "tools" not in tokenizer.kwargs and system["role"] == "system"
    assert json.dumps(WEATHER["function"]) in system["content"] and "JSON array of calls" in system["content"]
    assert assistant == {"role": "assistant", "content": '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'}
    assert tool == {"role": "tool", "content": "sunny"}


@pytest.mark.parametrize("template, reads", [
    ("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}", True),
    ("{%- for tool in tools %}{{ tool }}{% endfor %}", True),
    ("Use the tools wisely. {{ messages }}", False),  # the word in the text, not the variable
    ("{% set tools_used = 1 %}{{ messages }}", False),  # another name
])
def test_a_template_reads_tools_only_when_jinja_names_the_variable(template, reads):
    class Recorder(Template):
        def apply_chat_template(self, messages, **kwargs):
            self.messages, self.kwargs = messages, kwargs
            return "prompt"

    tokenizer = Recorder(template)
    plan = tools.plan(body(tools=[WEATHER], tool_choice="required"), tokenizer)
    tools.render_prompt(tokenizer, [{"role": "user", "content": "weather?"}], plan)
    assert ("tools" in tokenizer.kwargs) == reads
    assert (tokenizer.messages[0]["role"] == "system") == (not reads)
