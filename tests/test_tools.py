"""Tool calling: each format's parser on whole outputs and token by token; a required or named
tool_choice enforced by a grammar on the default model (every call parses and its arguments validate
against the tool's parameters, in all three formats); and `kiln serve` with the `openai` client:
tools rendered by a chat template as Hermes/Qwen's renders them, tool_calls in responses and streamed
deltas, the conversation continued with the calls and their results, bad tool requests a 400."""
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.runtime.sampling_params import GuidedDecodingParams
from kiln.serve.tools import PARSERS, ToolStream, forced_calls_grammar, tool_schemas
from test_guided import engine_dir  # noqa: F401 - the default model's engine, shared

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                                                      "limit": {"type": "integer", "minimum": 1,
                                                                                "maximum": 10}},
                                     "required": ["query"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = tool_schemas(TOOLS)

# A chat template that renders tools, calls and results as Hermes 2 Pro's and Qwen2.5's do.
HERMES_TEMPLATE = (Path(__file__).parent / "hermes_tools.jinja")

OUTPUTS = {
    "hermes": ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "search", "arguments": {"query": "a \\"quoted\\" {brace}"}}\n'
               '</tool_call>', "Let me look."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "search", "parameters": {"query": "a \\"quoted\\" {brace}"}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "search", "arguments": {"query": "a \\"quoted\\" {brace}"}}]', None),
}
CALLS = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("search", {"query": 'a "quoted" {brace}'})]


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_parsers_whole_and_streamed(fmt):
    text, content = OUTPUTS[fmt]
    parser = PARSERS[fmt]()
    got_content, calls = parser.extract(text)
    assert got_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == CALLS
    assert all(re.fullmatch("call_[0-9a-f]{24}", c["id"]) for c in calls)
    for step in (1, 3, 7):  # token by token, as a stream delivers text
        stream, text_out, names, args = ToolStream(parser), "", {}, {}
        for i in range(0, len(text), step):
            new, deltas = stream.feed(text[i:i + step], final=i + step >= len(text))
            text_out += new
            for d in deltas:
                if "id" in d:
                    assert d["index"] not in names and d["type"] == "function"
                    names[d["index"]] = d["function"]["name"]
                args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
        assert (text_out.strip() or None) == content
        assert [(names[i], json.loads(args[i])) for i in sorted(names)] == CALLS


def test_plain_text_and_partial_calls():
    hermes = PARSERS["hermes"]()
    assert hermes.extract("no calls here") == ("no calls here", [])
    assert hermes.extract("<tool_call>\n{\"name\": \"x\", \"argu")[1] == []  # cut by max_tokens: no call
    stream = ToolStream(hermes)
    assert stream.feed("Sure <tool") == ("Sure ", [])  # a possible opening is held back
    assert stream.feed("_call>\n{\"arguments\": {\"a\": 1}, ") == ("", [])  # arguments before the name: wait
    content, deltas = stream.feed("\"name\": \"f\"}\n</tool_call>", final=True)
    assert deltas[0]["function"]["name"] == "f" and json.loads(deltas[1]["function"]["arguments"]) == {"a": 1}
    with pytest.raises(ValueError, match=r"tools\[0\] must be"):
        tool_schemas([{"type": "function", "function": {"description": "no name"}}])


@pytest.mark.parametrize("fmt", list(PARSERS))
def test_forced_calls_parse_and_validate(engine_dir, fmt):  # noqa: F811
    """tool_choice required / named (one call: parallel_tool_calls false): the grammar of the format
    around the tools' parameters schemas, at temperature 1.0 on the default model: every finished
    output is a call that parses and validates."""
    parser = PARSERS[fmt]()
    llm = LLM(engine_dir)
    guides = [forced_calls_grammar(parser, SCHEMAS, None, parallel=False),
              forced_calls_grammar(parser, SCHEMAS, "search", parallel=False)]
    outs = llm.generate(["def main():"] * 8, [
        SamplingParams(temperature=1.0, max_tokens=160, seed=i, guided_decoding=GuidedDecodingParams(grammar=g))
        for i, g in enumerate(guides * 4)])
    finished = 0
    for i, out in enumerate(outs):
        c = out.outputs[0]
        if c.finish_reason != "stop":
            continue
        finished += 1
        _, calls = parser.extract(c.text)
        assert len(calls) == 1, c.text
        for call in calls:
            name = call["function"]["name"]
            assert name == "search" or i % 2 == 0
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
    assert finished >= 4


# ------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def client(engine_dir, tmp_path_factory):  # noqa: F811
    from test_serve import Server

    server = Server(engine_dir, tmp_path_factory.mktemp("tools_serve") / "server.log", "--served_model_name", "m",
                    "--chat_template", str(HERMES_TEMPLATE), "--tool-call-parser", "hermes",
                    "--enable-auto-tool-choice")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_server_tool_calls(client, choice):
    for seed in range(4):
        r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False, max_tokens=160, temperature=1.0, seed=seed)
        c = r.choices[0]
        if c.finish_reason == "length":
            continue
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        # streamed: the deltas reassemble the same calls
        calls, finish = {}, None
        for chunk in client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                                    parallel_tool_calls=False, max_tokens=160, temperature=1.0,
                                                    seed=seed, stream=True):
            for d in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": None, "arguments": ""})
                if d.function.name:
                    entry["name"] = d.function.name
                entry["arguments"] += d.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls"
        assert [(e["name"], json.loads(e["arguments"])) for e in calls.values()] == \
            [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls]
        # the conversation goes on with the calls and their results, rendered by the template
        follow = MESSAGES + [c.message.model_dump(exclude_none=True)] + [
            {"role": "tool", "tool_call_id": t.id, "content": json.dumps({"temperature": 21})}
            for t in c.message.tool_calls]
        r2 = client.chat.completions.create(model="m", messages=follow, tools=TOOLS, tool_choice="none",
                                            max_tokens=8)
        assert r2.choices[0].message.tool_calls is None and r2.choices[0].message.content is not None
        return
    pytest.fail("no seed finished within max_tokens")


def test_server_auto_tool_choice(client):
    """auto: the model may answer in text; whatever it writes in the format is parsed."""
    r = client.chat.completions.create(model="m", messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=1)
    c = r.choices[0]
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert (c.message.tool_calls is None) == (c.finish_reason != "tool_calls")


@pytest.mark.parametrize("body, message", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice names function 'nope', which is not among the tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "tools[0] must be"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
])
def test_server_bad_tool_requests(client, body, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4, **{"tools": TOOLS, **body})
    assert message in e.value.body["message"]
