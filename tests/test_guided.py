"""Guided decoding (structured outputs): the guide's validation, the samplers' bitmask, and the engine
on the default model (a tiny model, so the grammar does the work) at temperature 1.0: every finished
output of a suite of JSON schemas validates with `jsonschema`, with and without speculative decoding,
with n > 1 and under preemption; regex, choice and EBNF outputs match; a truncated output finishes
with `length`. The OpenAI server's fields (response_format, vLLM's structured_outputs and guided_*)
through the `openai` client, the SDK's `parse` with a pydantic model included."""
import json
import re
from pathlib import Path

import jsonschema
import openai
import pytest
import torch

from json_schemas import SCHEMAS
from kiln import LLM, SamplingParams
from kiln.runtime.core.sample.rows import SampleRow
from kiln.runtime.core.sample.sampler import Sampler
from kiln.runtime.sampling_params import GuidedDecodingParams as Guide

DEFAULT_MODEL = Path(__file__).parents[1] / "models" / "kiln-tiny-stdlib"
MAX_TOKENS = 256
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


def valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema, format_checker=FORMATS)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory):
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint

    tmp = tmp_path_factory.mktemp("guided")
    ckpt = convert_checkpoint(DEFAULT_MODEL, tmp / "ckpt", dtype="bfloat16")
    return build_engine(ckpt, tmp / "engine", BuildConfig(max_batch_size=16, max_input_len=512, max_seq_len=768,
                                                          max_num_tokens=512), log=lambda *_: None)


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir)


# ------------------------------------------------------------------------------- the guide itself
@pytest.mark.parametrize("fields, message", [
    ({}, "exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["b"]}, "got regex, choice"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"json": {"type": "no-such-type"}}, 'guided_decoding.json is not valid: Unsupported type "no-such-type"'),
    ({"json": "{not json"}, "guided_decoding.json is not valid: Failed to parse JSON"),
    ({"regex": "(ab"}, "guided_decoding.regex is not valid: Regex parsing error at position 4"),
    ({"grammar": 'root ::= "a" |'}, "guided_decoding.grammar is not valid: EBNF parser error at line 1"),
])
def test_bad_guides_name_the_field(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Guide(**fields).check()


def test_guide_forms():
    from pydantic import BaseModel

    class Point(BaseModel):
        x: int
        y: int

    assert json.loads(Guide(json=Point).json)["required"] == ["x", "y"]
    assert Guide(json={"type": "object"}).key == Guide(json='{"type": "object"}').key
    assert SamplingParams(guided_decoding={"regex": "[0-9]+"}).guided_decoding.kind == "regex"
    with pytest.raises(ValueError, match="guided_decoding must be a GuidedDecodingParams"):
        SamplingParams(guided_decoding="json")


# ------------------------------------------------------------------------------- the samplers
@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_samplers_apply_the_bitmask_first(backend):
    """Refused tokens are never drawn, greedy takes the best allowed one, and logprobs are those of the
    masked logits (as vLLM applies its grammar bitmask to the logits); C++ and torch agree."""
    torch.manual_seed(0)
    V = 100  # not a multiple of 32: the last word's unused bits are set
    logits = torch.randn(6, V)
    allowed = torch.rand(6, V) < 0.2
    allowed[:, 7] = True
    words = torch.zeros(6, 4, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    words[:, 3] |= ~((1 << (V % 32)) - 1) & 0xFFFFFFFF
    words = ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the bits as int32
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=1.0, seed=1, logprobs=1),
              SamplingParams(temperature=0.7, top_k=5, seed=2), SamplingParams(temperature=0, repetition_penalty=1.3),
              SamplingParams(temperature=1.0, top_p=0.5, seed=3), SamplingParams(temperature=0)]
    rows = [SampleRow(p, [7, 8], [], allowed=words[i] if i != 5 else None) for i, p in enumerate(params)]
    out = Sampler(backend)(logits, rows)
    masked = logits.masked_fill(~allowed, float("-inf"))
    for i, token in enumerate(out.token_ids):
        if i == 5:
            assert token == int(logits[5].argmax())  # unguided
            continue
        assert allowed[i, token]
    assert out.token_ids[0] == int(masked[0].argmax())
    expected = torch.log_softmax(masked[0], -1)
    for t, lp in out.logprobs[0].items():
        assert lp == pytest.approx(float(expected[t]), abs=1e-5)
    other = Sampler("torch" if backend == "cpp" else "cpp")(logits, rows)
    assert other.token_ids[0] == out.token_ids[0] and other.token_ids[3] == out.token_ids[3]
    processed = Sampler(backend).process_logits(logits, rows)
    assert torch.isinf(processed[:5][~allowed[:5]]).all()


# ------------------------------------------------------------------------------- the engine
SUITE = {k: v for k, v in SCHEMAS.items() if k != "format_ipv4"}  # xgrammar's ipv4 allows leading zeros; Python's not


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}], ids=["plain", "ngram"])
def test_json_schema_suite(engine_dir, llm, spec):
    """At temperature 1.0 every finished output validates, and most finish (the grammar allows no
    whitespace to pad with); the guided outputs keep their schemas under speculative decoding. (The
    speculating engine runs on one thread: its bitmasks are filled on a thread of their own, while
    the step runs, as on a machine with a core to spare.)"""
    engine = llm if spec is None else LLM(engine_dir, speculative_config=spec, threads=1)
    assert engine.llm_engine.core.structured.overlap == (spec is not None)
    names = list(SUITE)
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=i, guided_decoding=Guide(json=SUITE[n]))
              for i, n in enumerate(names)]
    outs = engine.generate(["config = "] * len(names), params)
    finished = [(n, o.outputs[0]) for n, o in zip(names, outs) if o.outputs[0].finish_reason == "stop"]
    assert len(SUITE) >= 50 and len(finished) >= 0.8 * len(SUITE), [o.outputs[0].finish_reason for o in outs]
    bad = [(n, c.text) for n, c in finished if not valid(c.text, SUITE[n])]
    assert not bad, bad
    if spec is not None:
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_regex_choice_grammar_and_samples(llm):
    guides = {"regex": Guide(regex=r"[a-z]{2,5}-[0-9]{3}"), "choice": Guide(choice=["yes", "no", "it \"depends\""]),
              "grammar": Guide(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [0-9]+ | "x"'),
              "json_object": Guide(json_object=True)}
    checks = {"regex": lambda t: re.fullmatch(r"[a-z]{2,5}-[0-9]{3}", t),
              "choice": lambda t: t in ("yes", "no", 'it "depends"'),
              "grammar": lambda t: re.fullmatch(r"\((?:[0-9]+|x)(?:,(?:[0-9]+|x))*\)", t),
              "json_object": lambda t: isinstance(json.loads(t), dict)}
    outs = llm.generate(["def f(x):"] * len(guides), [
        SamplingParams(temperature=1.0, n=3, seed=i, max_tokens=64, guided_decoding=g)
        for i, g in enumerate(guides.values())])
    for kind, out in zip(guides, outs):
        assert len(out.outputs) == 3
        for c in out.outputs:
            if c.finish_reason == "stop":
                assert checks[kind](c.text), (kind, c.text)
        assert any(c.finish_reason == "stop" for c in out.outputs), kind


def test_truncated_output_is_length(llm):
    out = llm.generate(["x = "], SamplingParams(temperature=0, max_tokens=3, guided_decoding=Guide(
        json=SCHEMAS["many_fields"])))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 3 and out.text.startswith("{")


def test_preempted_guided_requests_stay_valid(engine_dir):
    """A KV cache too small for the batch preempts and recomputes sequences; their matchers are
    untouched by it, and every finished output validates."""
    small = LLM(engine_dir, max_tokens_in_paged_kv_cache=16 * 32, enable_prefix_caching=False)
    names = [n for n in SUITE][:16]
    prompts = [f"data_{i} = " * 12 for i in range(len(names))]
    params = [SamplingParams(temperature=1.0, max_tokens=96, seed=i, guided_decoding=Guide(json=SUITE[n]))
              for i, n in enumerate(names)]
    outs = small.generate(prompts, params)
    assert small.llm_engine.core.stats().num_preemptions > 0
    for n, o in zip(names, outs):
        if o.outputs[0].finish_reason == "stop":
            assert valid(o.outputs[0].text, SUITE[n]), (n, o.outputs[0].text)


def test_a_bad_guide_fails_before_the_queue(llm):
    with pytest.raises(ValueError, match="guided_decoding.regex is not valid"):
        llm.generate(["x"], SamplingParams(guided_decoding=Guide(regex="[a-")))
    assert llm.generate(["x"], SamplingParams(max_tokens=2))[0].outputs[0].token_ids  # still serving


# ------------------------------------------------------------------------------- the OpenAI server
@pytest.fixture(scope="module")
def client(engine_dir, tmp_path_factory):
    from test_serve import Server

    server = Server(engine_dir, tmp_path_factory.mktemp("guided_serve") / "server.log", "--served_model_name", "m")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    server.stop()


def test_server_response_format_and_parse(client):
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        name: str = Field(max_length=12)
        quantity: int = Field(ge=0, le=99)
        urgent: bool

    messages = [{"role": "user", "content": "an item"}]
    r = client.chat.completions.parse(model="m", messages=messages, response_format=Item, max_tokens=MAX_TOKENS,
                                      seed=3)
    assert r.choices[0].finish_reason == "stop" and isinstance(r.choices[0].message.parsed, Item)
    schema = Item.model_json_schema()
    text = ""
    for chunk in client.chat.completions.create(
            model="m", messages=messages, max_tokens=MAX_TOKENS, stream=True, seed=4,
            response_format={"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}):
        text += chunk.choices[0].delta.content or "" if chunk.choices else ""
    assert valid(text, schema), text
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=MAX_TOKENS, seed=5, n=4,
                                       response_format={"type": "json_object"})
    finished = [c.message.content for c in r.choices if c.finish_reason == "stop"]
    assert finished and all(isinstance(json.loads(t), dict) for t in finished)


@pytest.mark.parametrize("body, check", [
    ({"guided_json": SCHEMAS["flat_mixed"]}, lambda t: valid(t, SCHEMAS["flat_mixed"])),
    ({"guided_regex": "[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{4}", t)),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"guided_grammar": 'root ::= "a" [b-d]+'}, lambda t: re.fullmatch("a[b-d]+", t)),
    ({"structured_outputs": {"json": SCHEMAS["enum_string"]}}, lambda t: valid(t, SCHEMAS["enum_string"])),
    ({"structured_outputs": {"choice": ["x", "y"]}}, lambda t: t in ("x", "y")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS["int_bounds"]}}},
     lambda t: valid(t, SCHEMAS["int_bounds"])),
])
def test_server_completion_fields(client, body, check):
    r = client.completions.create(model="m", prompt="value = ", max_tokens=64, seed=1, extra_body=body)
    c = r.choices[0]
    assert c.finish_reason == "length" or check(c.text), c.text


@pytest.mark.parametrize("body, param, message", [
    ({"guided_regex": "(ab"}, "guided_regex", "guided_regex is not valid: Regex parsing error"),
    ({"guided_json": {"type": "nope"}}, "guided_json", 'guided_json is not valid: Unsupported type "nope"'),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "only one structured-output field"),
    ({"structured_outputs": {"regex": "a", "grammar": "root ::= \"a\""}}, "structured_outputs", "exactly one of"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema.schema"),
])
def test_server_bad_guides_are_400(client, body, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt="x", max_tokens=4, extra_body=body)
    assert message in e.value.body["message"] and e.value.body["param"] == param
    assert client.completions.create(model="m", prompt="x", max_tokens=2).choices  # still serving
