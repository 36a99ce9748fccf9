"""Structured outputs and tool calls through the real server, with the official `openai` client on the
default model (SmolLM2, whose chat template has no tool-call format).

Outputs are checked by `jsonschema` against the schemas the requests sent; a streamed tool call is
assembled by the openai client's own stream helper and must equal the non-streamed one (greedy);
the pool is read from /metrics.
"""

from __future__ import annotations

import json
import re

import pytest
from conftest import DEFAULT_MODEL_NAME as MODEL
from conftest import PERSON_SCHEMA, error_of, wait_idle

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def check_calls(message, names=tuple(SCHEMAS)) -> list[tuple[str, str]]:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


@pytest.mark.weights
def test_json_schema_response_format_parses_and_validates_on_both_endpoints(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}}
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=200, response_format=fmt,
        messages=[{"role": "user", "content": "Describe a person named Anna who lives in Paris and has two pets, as JSON."}])
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), PERSON_SCHEMA)
    completion = client.completions.create(model=MODEL, prompt="A person, as JSON:", temperature=0, max_tokens=200,
                                           extra_body={"response_format": fmt})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), PERSON_SCHEMA)
    # Any object: the 135M model greedy often nests keys until max_tokens; this prompt ends.
    anything = client.completions.create(model=MODEL, prompt="A JSON object about a dog:", temperature=0,
                                         max_tokens=100, extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].text), dict)
    wait_idle(server)


@pytest.mark.weights
def test_vllms_structured_outputs_field_holds_the_output(server, client):
    digits = client.completions.create(model=MODEL, prompt="The year was", temperature=0, max_tokens=10,
                                       extra_body={"structured_outputs": {"regex": " [0-9]{4}"}})
    assert re.fullmatch(r" [0-9]{4}", digits.choices[0].text) and digits.choices[0].finish_reason == "stop"
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}],
                                            temperature=0, max_tokens=10,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"structured_outputs": {"regex": "a", "choice": ["b"]}})
    assert error_of(raised.value)["param"] == "structured_outputs"


@pytest.mark.weights
def test_required_and_named_tool_choice_give_calls_whose_arguments_validate(server, client):
    required = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=100)
    assert required.choices[0].finish_reason == "tool_calls"
    check_calls(required.choices[0].message)
    named = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=100)
    assert named.choices[0].finish_reason == "tool_calls" and named.choices[0].message.content is None
    assert len(check_calls(named.choices[0].message, names=("get_weather",))) == 1
    # the conversation goes on: the call and its result are sent back
    call = named.choices[0].message.tool_calls[0]
    history = [*WEATHER, {"role": "assistant", "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=20)
    assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
    wait_idle(server)


@pytest.mark.weights
@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_streamed_tool_call_deltas_assemble_to_the_non_streamed_calls(server, client, tool_choice):
    whole = client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                           temperature=0, max_tokens=100)
    chunks = list(client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                                 temperature=0, max_tokens=100, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) > 2  # the arguments arrive in pieces, not at the end
    first = deltas[0][0]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name in SCHEMAS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(model=MODEL, messages=WEATHER, tools=TOOLS, tool_choice=tool_choice,
                                        temperature=0, max_tokens=100) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert check_calls(final.choices[0].message) == check_calls(whole.choices[0].message)
    wait_idle(server)


@pytest.mark.weights
def test_auto_tool_choice_on_a_model_without_a_parser_is_a_400_naming_the_reason(server, client):
    for extra in ({"tool_choice": "auto"}, {}):  # "auto" is the default when tools are given
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=MODEL, messages=WEATHER, tools=TOOLS, max_tokens=10, **extra)
        error = error_of(raised.value)
        assert error["param"] == "tool_choice" and "parser" in error["message"]
    wait_idle(server)


@pytest.mark.weights
def test_a_schema_that_does_not_compile_is_a_400_and_the_server_serves_on(server, client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=10, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "nonsense"}}})
    assert "does not compile" in error_of(raised.value)["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=10, tools=TOOLS,
                                       tool_choice="required", response_format={"type": "json_object"})
    assert error_of(raised.value)["param"] == "response_format"
    ok = client.chat.completions.create(model=MODEL, messages=WEATHER, max_tokens=4, temperature=0)
    assert ok.choices[0].message.content
    wait_idle(server)
