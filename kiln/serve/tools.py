"""Tool calling on /v1/chat/completions: the formats models write their calls in, parsed out of the
output (whole, or delta by delta while it streams), and the grammar that makes a `required` or named
`tool_choice` always produce a call that parses (vLLM's `--tool-call-parser` names):

- `hermes` (Hermes 2 Pro, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  as many as the model writes, after any text;
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the output is `{"name": ..., "parameters": {...}}` (optionally
  after `<|python_tag|>`), several separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after any text;
- without a parser, a `required` or named `tool_choice` is generated, as vLLM does it, as a JSON array
  `[{"name": ..., "parameters": {...}}, ...]` under a grammar from the request's tools (`JsonCalls`): no
  model-specific format is involved, and clients see only OpenAI's `tool_calls`.

A call's arguments stream as their raw JSON text grows: the first delta of a call carries its id and
name, the next ones the arguments' new characters, which concatenate to the complete JSON.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def json_end(text: str, i: int) -> int | None:
    """The end of the JSON value starting at text[i] (after whitespace), or None if it is not complete
    within text (or not JSON at all: then -1)."""
    n = len(text)
    while i < n and text[i] in " \t\r\n":
        i += 1
    if i == n:
        return None
    if text[i] not in "{[":
        try:
            _, end = json.JSONDecoder().raw_decode(text, i)
        except ValueError:
            return None if text[i] in '"-0123456789tfn' else -1
        return end if end < n or text[i] == '"' else None  # a number may go on
    depth, in_str, esc = 0, False, False
    for j in range(i, n):
        c = text[j]
        if in_str:
            esc, in_str = (False, in_str) if esc else (c == "\\", c != '"')
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _string_field(obj: str, key: str) -> str | None:
    """The value of `"key": "..."` in a (partial) JSON object, once it is complete."""
    at = obj.find(f'"{key}"')
    if at < 0:
        return None
    colon = obj.find(":", at + len(key) + 2)
    if colon < 0:
        return None
    end = json_end(obj, colon + 1)
    if end is None or end < 0:
        return None
    try:
        value = json.loads(obj[colon + 1:end])
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _arguments_span(obj: str, keys: tuple[str, ...]) -> tuple[int, int | None] | None:
    """(start, end or None while incomplete) of the arguments object's raw text in a partial call."""
    for key in keys:
        at = obj.find(f'"{key}"')
        if at < 0:
            continue
        colon = obj.find(":", at + len(key) + 2)
        if colon < 0:
            return None
        start = colon + 1
        while start < len(obj) and obj[start] in " \t\r\n":
            start += 1
        if start == len(obj):
            return None
        end = json_end(obj, start)
        return start, (None if end is None or end < 0 else end)
    return None


@dataclass
class CallState:
    """One call being streamed: what of it was sent."""
    id: str = field(default_factory=call_id)
    name_sent: bool = False
    args_sent: int = 0  # characters of the arguments' raw text sent


class ToolParser:
    """A format: `opening` starts the calls region; the calls are JSON objects, each possibly wrapped
    (`wrap` before / `unwrap` after it) and separated by `separators`."""
    opening: str = ""
    wrap: str = ""
    unwrap: str = ""
    separators: str = ""
    args_keys: tuple[str, ...] = ("arguments", "parameters")
    array = False  # the calls region is one JSON array (mistral)

    def region(self, text: str, start: int) -> str:
        """The calls region of text whose calls begin at start (a wrapped format's opening is its
        first call's wrap)."""
        return text[start:] if self.wrap else text[start + len(self.opening):]

    def calls_start(self, text: str) -> int | None:
        """Where the calls region begins in the output, or None (not yet / not at all)."""
        at = text.find(self.opening)
        return None if at < 0 else at

    def maybe_later(self, text: str) -> int:
        """Characters at the end of text that may begin the opening (held back while streaming)."""
        for k in range(min(len(self.opening), len(text)), 0, -1):
            if self.opening.startswith(text[-k:]):
                return k
        return 0

    def objects(self, region: str) -> list[tuple[int, int | None]]:
        """(start, end or None while incomplete) of each call object in the calls region."""
        out, i, n = [], 0, len(region)
        if self.array:
            i = region.find("[")
            if i < 0:
                return out
            i += 1
        while i < n:
            while i < n and (region[i] in " \t\r\n" + self.separators):
                i += 1
            if self.wrap:
                if region.startswith(self.wrap, i):
                    i += len(self.wrap)
                elif self.wrap.startswith(region[i:]) or i == n:
                    return out
                else:
                    skip = region.find(self.wrap, i)
                    if skip < 0:
                        return out
                    i = skip + len(self.wrap)
            while i < n and region[i] in " \t\r\n":
                i += 1
            if i == n or region[i] != "{":
                return out
            end = json_end(region, i)
            if end is None:
                out.append((i, None))
                return out
            if end < 0:
                return out
            out.append((i, end))
            i = end
            if self.unwrap:
                while i < n and region[i] in " \t\r\n":
                    i += 1
                if region.startswith(self.unwrap, i):
                    i += len(self.unwrap)
        return out

    def extract(self, text: str) -> tuple[str | None, list[dict]]:
        """(the content before the calls, or None; the calls, OpenAI's objects) of a whole output."""
        start = self.calls_start(text)
        if start is None:
            return text, []
        region = self.region(text, start)
        calls = []
        for a, b in self.objects(region):
            if b is None:
                break
            call = self._call(region[a:b])
            if call is not None:
                calls.append(call)
        if not calls:
            return text, []
        content = self.content_before(text, start).strip()
        return content or None, calls

    def content_before(self, text: str, start: int) -> str:
        return text[:start]

    def _call(self, obj: str) -> dict | None:
        try:
            d = json.loads(obj)
        except ValueError:
            return None
        name = d.get("name") if isinstance(d, dict) else None
        args = next((d[k] for k in self.args_keys if k in d), {}) if isinstance(d, dict) else None
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        return {"id": call_id(), "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


class Hermes(ToolParser):
    opening = "<tool_call>"
    wrap = "<tool_call>"
    unwrap = "</tool_call>"


class Llama3Json(ToolParser):
    opening = ""
    separators = ";"
    args_keys = ("parameters", "arguments")

    def calls_start(self, text):
        stripped = text.lstrip()
        if stripped.startswith("<|python_tag|>"):
            stripped = stripped[len("<|python_tag|>"):].lstrip()
        if not stripped:
            return None
        return len(text) - len(stripped) if stripped[0] == "{" else None

    def maybe_later(self, text):
        return len(text) if "<|python_tag|>".startswith(text.strip()) else 0

    def content_before(self, text, start):
        return ""  # whitespace and <|python_tag|>: the output is the calls


class Mistral(ToolParser):
    opening = "[TOOL_CALLS]"
    separators = ","
    array = True


class JsonCalls(ToolParser):
    """The calls of a forced tool_choice on a server without --tool-call-parser: the whole output is one
    JSON array of {"name", "parameters"} objects (vLLM's form for them)."""
    separators = ","
    array = True
    args_keys = ("parameters", "arguments")

    def calls_start(self, text):
        stripped = text.lstrip()
        return len(text) - len(stripped) if stripped.startswith("[") else None

    def content_before(self, text, start):
        return ""


PARSERS = {"hermes": Hermes, "llama3_json": Llama3Json, "mistral": Mistral}


def tool_schemas(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of each function tool; ValueError naming what is wrong."""
    out = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                             f"{{...}}}}}}, got {json.dumps(tool)[:200]}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
        out[fn["name"]] = params
    return out


def forced_calls_grammar(parser: ToolParser, schemas: dict[str, dict], name: str | None, parallel: bool = True) -> str:
    """EBNF forcing a call in the parser's format (several if parallel, OpenAI's parallel_tool_calls),
    of function `name` (or of any tool): the call objects follow the tool's parameters schema, so that
    each call parses and validates."""
    import xgrammar as xgr

    names = [name] if name is not None else list(schemas)
    key = parser.args_keys[0]
    call = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, key: schemas[n]},
                       "required": ["name", key], "additionalProperties": False} for n in names]}
    grammar = xgr.Grammar.from_json_schema(json.dumps(call), any_whitespace=False)
    body = f"{json.dumps(parser.wrap + chr(10))} call {json.dumps(chr(10) + parser.unwrap)}"
    one, sep = ("call", '"," " "?') if parser.array else ("call", '"; "') if parser.separators else (body, '"\\n"')
    calls = f"{one} ({sep} {one})*" if parallel else one
    top = f'root ::= {json.dumps(parser.opening)} "[" {calls} "]"' if parser.array else f"root ::= {calls}"
    # The schema's grammar, its root renamed `call`, under the format's own root.
    schema_rules = str(grammar).replace("root ::=", "call ::=", 1)
    return top + "\n" + schema_rules


class ToolStream:
    """Streams an output's content and tool-call deltas (OpenAI's `delta.tool_calls`) as it grows."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.content_sent, self.calls = parser, "", 0, []
        self.region_start: int | None = None

    def feed(self, new: str, final: bool = False) -> tuple[str, list[dict]]:
        """(new content text, new tool-call deltas)."""
        self.text += new
        p = self.parser
        if self.region_start is None:
            start = p.calls_start(self.text)
            if start is None:
                hold = 0 if final else p.maybe_later(self.text)
                content = self.text[self.content_sent:len(self.text) - hold]
                self.content_sent += len(content)
                return content, []
            self.region_start = start
            content = p.content_before(self.text, start)[self.content_sent:]
            self.content_sent = start
        else:
            content = ""
        region = p.region(self.text, self.region_start)
        deltas = []
        for index, (a, b) in enumerate(p.objects(region)):
            if index == len(self.calls):
                self.calls.append(CallState())
            state, obj = self.calls[index], region[a:b] if b is not None else region[a:]
            if not state.name_sent:
                name = _string_field(obj, "name")
                span = _arguments_span(obj, p.args_keys)
                if name is None or (span is not None and span[0] < obj.find('"name"')):
                    if b is None:
                        break  # the arguments come first: wait for the whole call
                    call = p._call(obj)
                    if call is None:
                        continue
                    name = call["function"]["name"]
                deltas.append({"index": index, "id": state.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
                state.name_sent = True
            span = _arguments_span(obj, p.args_keys)
            if span is not None:
                raw = obj[span[0]:span[1]] if span[1] is not None else obj[span[0]:]
                if span[1] is None and not final:
                    raw = raw.rstrip()
                if len(raw) > state.args_sent:
                    deltas.append({"index": index, "function": {"arguments": raw[state.args_sent:]}})
                    state.args_sent = len(raw)
            elif b is not None and state.args_sent == 0:
                deltas.append({"index": index, "function": {"arguments": "{}"}})
                state.args_sent = 2
        return content, deltas
