"""The Triton backend as its users meet it: a repository from `kiln triton-repo`, served by a real
`tritonserver` that `kiln triton-serve` starts on loopback ports, driven the way tensorrtllm_backend's
clients drive it (HTTP generate / generate_stream, `tritonclient.grpc` streams). Greedy outputs
equal `LLM.generate`; 32 concurrent streams share the in-flight batch; cancellation by each of the
three routes frees the request's KV blocks; bad input gets an error naming it and the server keeps
serving; the dashboards' and alert rules' metric names exist on the real /metrics of tritonserver
and kiln serve; benchmarks/serving.py targets Triton; a repeated prompt reuses its cached KV blocks;
a non-decoupled repository (reuse off) answers once per request; logits and token counts come as
TensorRT-LLM returns them, streamed or not, and the encoder-decoder tensors its scripts send are
empty; SIGTERM drains (the last test: it stops the server). What needs no server is in
tests/test_triton_repo.py; the clients are in tests/triton_client.py."""
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from click.testing import CliRunner

from kiln import LLM, SamplingParams
from kiln.cli import cli
from kiln.runtime.frontend.detokenizer import IncrementalDetokenizer
from tiny_models import PROMPTS
from triton_client import (Stream, Triton, engine_inputs, free_port, free_ports, grpc_inputs, idle, kv, ready, sse,
                           wait_for)

ROOT = Path(__file__).parent.parent
MAX_TOKENS = 12
LONG = 900  # tokens a cancelled request asks for (the engine's max_seq_len is 1024)


# ----------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", max_seq_len=1024, max_beam_width=4)  # room for requests that run until cancelled


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, threads=1)


@pytest.fixture(scope="module")
def repo(engine_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("triton") / "repo"
    result = CliRunner().invoke(cli, ["triton-repo", "--engine_dir", str(engine_dir), "--output_dir", str(out),
                                      "--param", "cancellation_check_period_ms=10",
                                      "--param", "stats_check_period_ms=20",
                                      "--param", "batch_scheduler_policy=max_utilization"])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def server(repo, tmp_path_factory):
    s = Triton(repo, tmp_path_factory.mktemp("triton_log") / "server.log")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


# ------------------------------------------------------------------------- serving: outputs
def readme_body() -> dict:
    """The body of the README's `curl .../ensemble/generate`."""
    return json.loads(re.search(r"ensemble/generate \\\n\s*-d '([^']*)'", (ROOT / "README.md").read_text()).group(1))


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_generate_equals_llm_generate(http, llm, model):
    body = readme_body()
    prompt = body["text_input"]
    ref = llm.generate(prompt, greedy(body["max_tokens"]))[0].outputs[0]
    r = http.post(f"/v2/models/{model}/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == prompt + ref.text  # as TensorRT-LLM: the prompt, then the output
    r = http.post(f"/v2/models/{model}/generate", json={**body, "exclude_input_in_output": True})
    assert r.json()["text_output"] == ref.text
    # TensorRT-LLM's client default: temperature 1.0 and no top_k/top_p is still greedy search
    r = http.post(f"/v2/models/{model}/generate", json={**body, "temperature": 1.0, "exclude_input_in_output": True})
    assert r.json()["text_output"] == ref.text


def text_steps(tok, prompt: list[int], tokens: list[int]) -> int:
    """Responses a stream of `tokens` takes: one per token that adds text (a token that ends in a
    partial UTF-8 sequence waits for the next), and the last."""
    d = IncrementalDetokenizer(tok, prompt)
    return sum(bool(d.add(t)) for t in tokens[:-1]) + 1


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_generate_stream_streams_token_by_token(http, llm, model):
    # The tiny model's continuations: of "x", a token of text each; of "# comment", two bytes that are
    # no text at first (they wait for the next token)
    for prompt in (PROMPTS[4], "# comment"):
        out = llm.generate(prompt, greedy(24))[0]
        ref = out.outputs[0]
        events = sse(http, model, {"text_input": prompt, "max_tokens": 24, "stream": True})
        chunks = [e["text_output"] for e in events]
        assert "".join(chunks) == ref.text
        # a response per token that adds text, unless the stream fell behind: then one for the steps it missed
        steps = text_steps(llm.get_tokenizer(), out.prompt_token_ids, ref.token_ids)
        assert steps > 12 and steps // 2 < len(chunks) <= steps


def test_grpc_streaming_gets_the_same_tokens_and_logprobs(server, llm):
    prompt = llm.get_tokenizer().encode(PROMPTS[2])
    ref = llm.generate({"prompt_token_ids": prompt}, greedy(logprobs=0))[0].outputs[0]
    stream = Stream(server)
    try:
        stream.send("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, streaming=True, return_log_probs=True))
        tokens, logprobs, cum = [], [], None
        for result in stream.responses():
            new = result.as_numpy("output_ids")[0, 0].tolist()
            assert result.as_numpy("sequence_length")[0, 0] == len(new)
            tokens += new
            logprobs += result.as_numpy("output_log_probs")[0, 0].tolist()
            cum = result.as_numpy("cum_log_probs")[0, 0]
        assert tokens == ref.token_ids
        assert logprobs == pytest.approx([lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)], abs=1e-5)
        assert cum == pytest.approx(ref.cumulative_logprob, abs=1e-5)
        # the ensemble over gRPC: the same text, chunk by chunk
        stream.send("ensemble", grpc_inputs(text_input=np.array([[PROMPTS[2].encode()]], object),
                                            max_tokens=np.array([[MAX_TOKENS]], np.int32), stream=np.array([[True]])))
        chunks = [r.as_numpy("text_output")[0].decode() for r in stream.responses()]
        assert "".join(chunks) == ref.text and len(chunks) > 1
        # num_return_sequences: each sample in its own responses, told apart by sequence_index
        stream.send("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, num_return_sequences=2))
        samples = {int(r.as_numpy("sequence_index")[0, 0]): r.as_numpy("output_ids")[0, 0].tolist()
                   for r in stream.responses()}
        assert samples == {0: prompt + ref.token_ids, 1: prompt + ref.token_ids}  # greedy: the same twice
    finally:
        stream.close()


def test_non_streaming_outputs_logits_and_perf_metrics(server, llm):
    """tensorrt_llm without streaming: output_ids with or without the prompt, log probs, context and
    generation logits (equal to LLM.generate's, which tests/test_trtllm_extras.py holds to HF), and
    return_perf_metrics' outputs, which end_to_end_grpc_client.py asks for by name."""
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    ref = llm.generate({"prompt_token_ids": prompt}, greedy(logprobs=0, return_context_logits=True,
                                                            return_generation_logits=True))[0]
    stream = Stream(server)
    with_prompt = stream.call("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS))
    assert with_prompt.as_numpy("output_ids")[0, 0].tolist() == prompt + ref.outputs[0].token_ids
    perf = ["kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
            "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
            "total_accepted_draft_tokens", "total_draft_tokens"]
    r = stream.call("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, exclude_input_in_output=True,
                                                   return_log_probs=True, return_context_logits=True,
                                                   return_generation_logits=True, return_perf_metrics=True,
                                                   return_num_input_tokens=True, return_num_output_tokens=True),
                    ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs", "context_logits",
                     "generation_logits", "num_input_tokens", "num_output_tokens", *perf])
    c = ref.outputs[0]
    assert r.as_numpy("output_ids")[0, 0].tolist() == c.token_ids
    assert r.as_numpy("sequence_length")[0, 0] == len(c.token_ids)
    assert r.as_numpy("num_input_tokens")[0, 0] == len(prompt)
    assert r.as_numpy("num_output_tokens")[0, 0] == len(c.token_ids)
    assert r.as_numpy("output_log_probs")[0, 0] == pytest.approx([lp[t] for t, lp in zip(c.token_ids, c.logprobs)],
                                                                 abs=1e-5)
    np.testing.assert_allclose(r.as_numpy("context_logits")[0], ref.context_logits.numpy(), atol=1e-5)
    # TensorRT-LLM's non-streaming layout: [1, beam, max_tokens, vocab], zero after the sequence ends
    gen = r.as_numpy("generation_logits")
    assert gen.shape == (1, 1, MAX_TOKENS, ref.context_logits.shape[-1])
    np.testing.assert_allclose(gen[0, 0, :len(c.token_ids)], np.stack([g.numpy() for g in c.generation_logits]),
                               atol=1e-5)
    assert not gen[0, 0, len(c.token_ids):].any()
    m = {n: r.as_numpy(n)[0, 0] for n in perf}
    assert m["kv_cache_alloc_new_blocks"] == m["kv_cache_alloc_total_blocks"] == -(-(len(prompt) + MAX_TOKENS - 1)
                                                                                    // 8)
    assert m["kv_cache_reused_blocks"] == m["total_draft_tokens"] == m["acceptance_rate"] == 0
    assert 0 < m["arrival_time_ns"] <= m["first_scheduled_time_ns"] <= m["first_token_time_ns"] \
        <= m["last_token_time_ns"]
    stream.close()


def test_beam_search_in_tensorrt_llm_shapes(server, http, llm):
    """beam_width 4: one response holding four beams, best first, in TensorRT-LLM's shapes, equal to
    LLM.generate's beam search (held to HF by tests/test_beam_search.py); through the ensemble, four
    texts."""
    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPTS[1])
    ref = llm.generate({"prompt_token_ids": prompt}, SamplingParams(use_beam_search=True, n=4, max_tokens=MAX_TOKENS,
                                                                    length_penalty=0.5, logprobs=0))[0]
    beams = [c.token_ids[:-1] if c.finish_reason == "stop" and c.stop_reason is None else c.token_ids
             for c in ref.outputs]
    stream = Stream(server)
    r = stream.call("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, beam_width=4, len_penalty=0.5,
                                                   return_log_probs=True),
                    ["output_ids", "sequence_length", "cum_log_probs", "output_log_probs"])
    ids, lengths = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
    assert ids.shape == (1, 4, len(prompt) + max(map(len, beams))) and lengths.shape == (1, 4)
    assert [ids[0, i, :lengths[0, i]].tolist() for i in range(4)] == [prompt + b for b in beams]
    assert r.as_numpy("cum_log_probs")[0].tolist() == pytest.approx([c.cumulative_logprob for c in ref.outputs],
                                                                     abs=1e-5)
    lps = r.as_numpy("output_log_probs")
    assert lps.shape[:2] == (1, 4)
    assert lps[0, 0, :len(beams[0])].sum() == pytest.approx(ref.outputs[0].cumulative_logprob, abs=1e-4)
    with pytest.raises(Exception, match=r"beam_width must be in \[1, 4\]"):
        stream.call("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, beam_width=8))
    stream.close()
    body = {"text_input": PROMPTS[1], "max_tokens": MAX_TOKENS, "beam_width": 4, "len_penalty": 0.5,
            "exclude_input_in_output": True}
    r = http.post("/v2/models/ensemble/generate", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == [c.text for c in ref.outputs]


def test_streamed_logits_and_token_counts_as_tensorrt_llm_streams_them(server, llm):
    """Streaming (inflight_batcher_llm_client.py -S --return-context-logits ...): every response
    carries the whole context_logits, the generation_logits of its own tokens as [1, tokens, beam,
    vocab], and num_output_tokens of its own output_ids; num_input_tokens is the prompt's."""
    prompt = llm.get_tokenizer().encode(PROMPTS[2])
    ref = llm.generate({"prompt_token_ids": prompt}, greedy(return_context_logits=True,
                                                            return_generation_logits=True))[0]
    stream = Stream(server)
    try:
        stream.send("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, streaming=True, return_context_logits=True,
                                                  return_generation_logits=True, return_num_input_tokens=True,
                                                  return_num_output_tokens=True))
        responses = stream.responses()
        assert len(responses) > 1
        generated = []
        for r in responses:
            new = r.as_numpy("output_ids")[0, 0]
            np.testing.assert_allclose(r.as_numpy("context_logits")[0], ref.context_logits.numpy(), atol=1e-5)
            gen = r.as_numpy("generation_logits")
            assert gen.shape == (1, len(new), 1, ref.context_logits.shape[-1])
            generated += list(gen[0, :, 0])
            assert r.as_numpy("num_input_tokens")[0, 0] == len(prompt)
            assert r.as_numpy("num_output_tokens")[0, 0] == len(new)
        np.testing.assert_allclose(np.stack(generated), np.stack([g.numpy() for g in ref.outputs[0].generation_logits]),
                                   atol=1e-5)
    finally:
        stream.close()


def test_decoder_inputs_are_empty_for_a_decoder_only_engine(server, http, llm):
    """TensorRT-LLM's encoder-decoder tensors, which end_to_end_test.py reads and sends: preprocessing
    returns DECODER_INPUT_ID empty for a decoder-only engine, tensorrt_llm takes it so, and refuses
    decoder tokens by name (through the ensemble, from decoder_text_input)."""
    stream = Stream(server)
    try:
        pre = stream.call("preprocessing", grpc_inputs(QUERY=np.array([[PROMPTS[0].encode()]], object),
                                                      REQUEST_OUTPUT_LEN=np.array([[4]], np.int32)))
        ids, decoder = pre.as_numpy("INPUT_ID"), pre.as_numpy("DECODER_INPUT_ID")
        assert decoder.shape == (1, 0) and pre.as_numpy("REQUEST_DECODER_INPUT_LEN").tolist() == [[0]]
        inputs = grpc_inputs(input_ids=ids, decoder_input_ids=decoder, input_lengths=pre.as_numpy("REQUEST_INPUT_LEN"),
                             request_output_len=np.array([[4]], np.int32))
        out = stream.call("tensorrt_llm", inputs).as_numpy("output_ids")[0, 0].tolist()
        ref = llm.generate({"prompt_token_ids": ids[0].tolist()}, greedy(max_tokens=4))[0].outputs[0]
        assert out == ids[0].tolist() + ref.token_ids
        stream.send("tensorrt_llm", engine_inputs(ids[0].tolist(), 4) + grpc_inputs(
            decoder_input_ids=np.array([[1, 2]], np.int32)))
        with pytest.raises(Exception, match="decoder_input_ids is for encoder-decoder engines"):
            stream.get()
    finally:
        stream.close()
    r = http.post("/v2/models/ensemble/generate", json={"text_input": PROMPTS[0], "max_tokens": 4,
                                                        "decoder_text_input": "hello"})
    assert r.status_code == 400 and "decoder_input_ids is for encoder-decoder engines" in r.json()["error"]


def test_kv_cache_reuse_on_a_repeated_prompt(server, llm):
    """enable_kv_cache_reuse (on by default): the same long prompt again takes its full blocks from
    the prefix cache (all but the one holding its last token), with the same output."""
    prompt = llm.get_tokenizer().encode(f"# kv reuse\n{PROMPTS[2]}\n{PROMPTS[3]}")[:100]  # a prefix no test sent
    ref = llm.generate({"prompt_token_ids": prompt}, greedy())[0].outputs[0].token_ids
    before = kv(idle(server), "reused")
    perf = ["kv_cache_reused_blocks", "kv_cache_alloc_new_blocks", "kv_cache_alloc_total_blocks"]
    stream = Stream(server)
    first, second = (stream.call("tensorrt_llm", engine_inputs(prompt, MAX_TOKENS, return_perf_metrics=True),
                                 ["output_ids", *perf]) for _ in range(2))
    stream.close()
    (reused0, new0, total0), (reused, new, total) = ([r.as_numpy(n)[0, 0] for n in perf] for r in (first, second))
    assert first.as_numpy("output_ids")[0, 0].tolist() == second.as_numpy("output_ids")[0, 0].tolist() == prompt + ref
    assert reused0 == 0 and new0 == total0 == total
    assert reused == (len(prompt) - 1) // 8 > 0 and new == total - reused
    # TensorRT-LLM's cumulative count of reused blocks
    wait_for(lambda: kv(server.metrics(), "reused") >= before + reused, what="the reused blocks metric to rise")


# -------------------------------------------------------------------- serving: under load
def test_32_concurrent_streams_share_the_in_flight_batch(server, llm):
    prompts = [PROMPTS[i % 4] + " " * (i // 4 % 3) for i in range(32)]
    lengths = [4 + (7 * i) % 23 for i in range(32)]
    ref = [o.outputs[0].text for o in llm.generate(prompts, [greedy(n) for n in lengths])]
    before = idle(server)

    async def one(client, i):
        model = ("ensemble", "tensorrt_llm_bls")[i % 2]
        text = ""
        async with client.stream("POST", f"/v2/models/{model}/generate_stream",
                                 json={"text_input": prompts[i], "max_tokens": lengths[i], "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    text += event["text_output"]
        return text

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    assert asyncio.run(main()) == ref
    after = idle(server)

    def delta(kind):
        name = f'kiln_iterations_total{{iteration_type="{kind}"}}'
        return after[name] - before.get(name, 0)

    assert delta("multi_request") > 0  # steps that carried more than one request
    assert delta("mixed") > 0  # steps where a request's prompt joined others mid-generation
    assert after['nv_trt_llm_inflight_batcher_metrics{inflight_batcher_specific_metric="paused_requests"}'] == 0
    requests = 'nv_llm_input_token_len_count{response_metric_type="total_input_tokens"}'
    assert after[requests] - before[requests] == 32


def _sse_first_event_then_close(server, model, body):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", f"/v2/models/{model}/generate_stream", json=body) as r:
            assert r.status_code == 200
            next(line for line in r.iter_lines() if line.startswith("data: "))
    # leaving the block closes the connection mid-stream


def _grpc_first_response_then_cancel(server, ids):
    stream = Stream(server)
    stream.send("tensorrt_llm", engine_inputs(ids, LONG, streaming=True, end_id=-1))
    stream.get()
    stream.close(cancel=True)


def _stop_request(server, ids):
    """TensorRT-LLM's stop route: a request with `stop` for the same request id (here on an ensemble
    request, whose id reaches tensorrt_llm; the stopped stream ends with the tokens it has)."""
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v2/models/ensemble/generate_stream",
                           json={"id": "stop-me", "text_input": PROMPTS[0], "max_tokens": LONG, "stream": True,
                                 "end_id": -1}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            stop = client.post("/v2/models/tensorrt_llm/generate", json={
                "id": "stop-me", "input_ids": [0], "input_lengths": [0], "request_output_len": [0], "stop": True})
            assert stop.status_code == 200, stop.text
            rest = [line for line in lines if line.startswith("data: ")]  # the stream ends by itself
            assert all("error" not in json.loads(line[6:]) for line in rest)


@pytest.mark.parametrize("route", ["grpc_cancel", "sse_close_engine", "sse_close_bls", "stop_request"])
def test_cancellation_frees_the_requests_blocks(server, llm, route):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    before = idle(server)
    if route == "grpc_cancel":
        _grpc_first_response_then_cancel(server, ids)
    elif route == "sse_close_engine":
        _sse_first_event_then_close(server, "tensorrt_llm", {"input_ids": ids, "input_lengths": [len(ids)],
                                                             "request_output_len": [LONG], "streaming": True,
                                                             "end_id": [-1]})
    elif route == "sse_close_bls":
        _sse_first_event_then_close(server, "tensorrt_llm_bls", {"text_input": PROMPTS[0], "max_tokens": LONG,
                                                                 "stream": True, "end_id": -1})
    else:
        _stop_request(server, ids)
    after = idle(server)  # every KV block free again
    tokens = 'nv_llm_output_token_len_sum{response_metric_type="total_output_tokens"}'
    generated = after[tokens] - before[tokens]
    steps = after['nv_trt_llm_general_metrics{general_type="iteration_counter"}'] - \
        before['nv_trt_llm_general_metrics{general_type="iteration_counter"}']
    assert 0 < generated < LONG / 3 and steps < LONG / 3, (generated, steps)


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_guided_decoding(http, model):
    """TensorRT-LLM's guided_decoding_guide_type / guided_decoding_guide inputs: the output matches
    the guide; a guide that does not parse is an error naming it."""
    schema = json.dumps({"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]})
    for guide_type, guide, check in [("regex", "[0-9]{3}-[a-z]{2}", lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
                                     ("ebnf_grammar", 'root ::= "<" [a-c] [a-c]? ">"',
                                      lambda t: re.fullmatch("<[a-c]{1,2}>", t)),
                                     ("json_schema", schema, lambda t: json.loads(t)["a"] in (1, 2))]:
        r = http.post(f"/v2/models/{model}/generate", json={
            "text_input": "x", "max_tokens": 24, "exclude_input_in_output": True,
            "guided_decoding_guide_type": guide_type, "guided_decoding_guide": guide})
        assert r.status_code == 200 and check(r.json()["text_output"]), (guide_type, r.text)
    r = http.post(f"/v2/models/{model}/generate", json={"text_input": "x", "max_tokens": 4,
                                                        "guided_decoding_guide_type": "regex",
                                                        "guided_decoding_guide": "(ab"})
    assert r.status_code == 400 and "guided_decoding_guide (regex) is not valid" in r.json()["error"], r.text


# ------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_bad_input_is_an_error_naming_it_and_the_server_keeps_serving(http, model):
    cases = [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "x", "max_tokens": 4, "beam_width": 8}, "beam_width must be in [1, 4]"),
        ({"text_input": "x", "max_tokens": 4, "lora_task_id": 3}, "lora_task_id 3: the engine was built without adapters"),
        ({"text_input": "x " * 300, "max_tokens": 4}, "max_input_len"),
        ({"text_input": "x", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ]
    for body, message in cases:
        r = http.post(f"/v2/models/{model}/generate", json=body)
        assert r.status_code == 400 and message in r.json()["error"], (body, r.text)
    assert http.get("/v2/health/ready").status_code == 200
    r = http.post(f"/v2/models/{model}/generate", json={"text_input": "x", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["text_output"].startswith("x")


def test_bad_engine_inputs_over_grpc(server):
    stream = Stream(server)
    with pytest.raises(Exception, match="outside the vocabulary"):
        stream.call("tensorrt_llm", engine_inputs([5, 100000], 4))
    with pytest.raises(Exception, match="draft_input_ids: speculative decoding"):
        stream.call("tensorrt_llm", engine_inputs([5, 6], 4) + grpc_inputs(draft_input_ids=np.array([[1]], np.int32)))
    assert stream.call("tensorrt_llm", engine_inputs([5, 6], 4)).as_numpy("sequence_length")[0, 0] == 6
    stream.close()


# ------------------------------------------------------------- dashboards and alert rules
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or",
                "unless"}


def promql_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    expr = re.sub(r'"[^"]*"', "", expr)  # label values
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges and subqueries
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = re.findall(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {n for n in names if n not in PROMQL_WORDS}


def monitored() -> dict[str, set[str]]:
    """Metric names the dashboards and the rules query, by file."""
    out = {}
    for f in sorted((ROOT / "deploy" / "monitoring").glob("*.json")):
        exprs = [t["expr"] for p in json.loads(f.read_text())["panels"] for t in p["targets"]]
        out[f.name] = set().union(*map(promql_metrics, exprs))
    import yaml

    rules = yaml.safe_load((ROOT / "deploy" / "monitoring" / "alerts.yaml").read_text())
    for group in rules["groups"]:
        out[f"alerts.yaml:{group['name']}"] = set().union(*(promql_metrics(r["expr"]) for r in group["rules"]))
    return out


def exported(metrics_text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in metrics_text.splitlines() if line and line[0] != "#"}


def test_dashboards_and_rules_query_metrics_the_servers_export(server, engine_dir, tmp_path):
    assert promql_metrics('histogram_quantile(0.99, sum by (le) (rate(a:b_bucket{x="y"}[5m]))) / c > 0.95') == \
        {"a:b_bucket", "c"}
    triton = exported(httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).text)
    port = free_port()
    kiln = subprocess.Popen([str(Path(sys.executable).parent / "kiln"), "serve", "--engine_dir", str(engine_dir),
                             "--host", "127.0.0.1", "--port", str(port), "--threads", "1", "--no_access_log"],
                            stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)
    try:
        def healthy():
            assert kiln.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(healthy, timeout=300, what="kiln serve")
        serve = exported(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    finally:
        kiln.terminate()
        kiln.wait(timeout=60)
    queried = monitored()
    assert set(queried) == {"grafana-kiln-serve.json", "grafana-triton.json", "alerts.yaml:kiln-serve",
                            "alerts.yaml:kiln-triton"}
    for where, names in queried.items():
        # `up` is Prometheus' own series for every scrape target
        source = serve if "kiln-serve" in where else triton
        assert names - {"up"} and names - {"up"} <= source, (where, sorted(names - source - {"up"}))


# ------------------------------------------------------------------- benchmarks/serving.py
def test_serving_benchmark_targets_triton(server, llm):
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "serving.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = llm.get_tokenizer()
    requests = bench.make_requests(tok, 6, 16, 8, max_input=128, max_seq=1024, seed=0)
    runs = []
    for model in ("ensemble", "tensorrt_llm_bls"):
        results, duration = asyncio.run(bench.run_load(server.url, model, requests, 3, float("inf"), None, True,
                                                        tok, 0, backend="triton"))
        assert all(r.ok for r in results), [r.error for r in results]
        runs.append({"label": model, "target": model, "concurrency": 3, **bench.summarize(results, duration)})
    assert all(r["completed"] == 6 and r["mean_ttft_ms"] > 0 and r["output_throughput"] > 0 for r in runs)
    assert "tensorrt_llm_bls" in bench.table(runs)


# ------------------------------------------------------------ parameters checked at load
def test_models_check_their_parameters_at_load(repo, tmp_path):
    """A value `kiln triton-repo` would have refused, put in by hand: tritonserver itself (not
    `kiln triton-serve`, which checks first) fails to load the model, with triton-repo's message."""
    from kiln.triton_backend.server import command

    bad = tmp_path / "repo"
    shutil.copytree(repo / "tensorrt_llm", bad / "tensorrt_llm")
    config = bad / "tensorrt_llm" / "config.pbtxt"
    config.write_text(re.sub(r'(key: "stats_check_period_ms"\s*value: \{ string_value: )"\d+"', r'\1"often"',
                             config.read_text()))
    cmd, env = command(bad, "127.0.0.1", *free_ports(3), 5)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "tensorrt_llm: parameter stats_check_period_ms: expected an integer >= 1, got 'often'" in result.stderr


# ---------------------------------------------------------------- decoupled_mode false
def test_non_decoupled_repository(engine_dir, llm, tmp_path):
    """One response per request: batched rows come back as one (padded) response; streaming and
    n > 1 are refused with the reason."""
    out = tmp_path / "repo"
    result = CliRunner().invoke(cli, ["triton-repo", "--engine_dir", str(engine_dir), "--output_dir", str(out),
                                      "--param", "decoupled_mode=false", "--param", "enable_kv_cache_reuse=false"])
    assert result.exit_code == 0, result.output
    server = Triton(out, tmp_path / "server.log", activated=False)  # as the venv's kiln run by its path
    try:
        ref = llm.generate([PROMPTS[0], PROMPTS[4]], [greedy(4), greedy(6)])
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for model in ("ensemble", "tensorrt_llm_bls"):
                r = http.post(f"/v2/models/{model}/generate", json={"text_input": PROMPTS[0], "max_tokens": 4,
                                                                     "exclude_input_in_output": True})
                assert r.json()["text_output"] == ref[0].outputs[0].text, r.text
                r = http.post(f"/v2/models/{model}/generate",
                              json={"text_input": "x", "max_tokens": 4, "stream": True})
                assert r.status_code == 400 and "decoupled_mode: true" in r.json()["error"]
                # enable_kv_cache_reuse false: a repeated prompt is computed again
                r = http.post(f"/v2/models/{model}/generate", json={"text_input": PROMPTS[2], "max_tokens": 2,
                                                                     "return_perf_metrics": True})
                assert r.json()["kv_cache_reused_blocks"] == 0, r.text
        assert kv(idle(server), "reused") == 0
        ids = [o.prompt_token_ids for o in ref]
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        r = client.infer("tensorrt_llm", grpc_inputs(
            input_ids=np.array([ids[0], ids[1] + [0] * (len(ids[0]) - len(ids[1]))], np.int32),
            input_lengths=np.array([[len(i)] for i in ids], np.int32),
            request_output_len=np.array([[4], [6]], np.int32), pad_id=np.array([[2], [2]], np.int32)))
        lengths = r.as_numpy("sequence_length")[:, 0].tolist()
        assert lengths == [len(i) + len(o.outputs[0].token_ids) for i, o in zip(ids, ref)]
        for row, (i, o) in enumerate(zip(ids, ref)):
            got = r.as_numpy("output_ids")[row, 0].tolist()
            assert got[:lengths[row]] == i + o.outputs[0].token_ids and set(got[lengths[row]:]) <= {2}
        client.close()
    finally:
        server.stop()
    assert server.proc.returncode == 0


# ------------------------------------------------------- SIGTERM (last: it stops the server)
def test_sigterm_drains_requests_in_flight(server, http, llm):
    ref = llm.generate(PROMPTS[4], greedy(80, ignore_eos=True))[0].outputs[0]
    http.close()  # Triton's drain waits for open HTTP connections (keep-alive ones too) until its timeout
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v2/models/ensemble/generate_stream",
                           json={"text_input": PROMPTS[4], "max_tokens": 80, "stream": True, "end_id": -1}) as r:
            lines = r.iter_lines()
            text = json.loads(next(line for line in lines if line.startswith("data: "))[6:])["text_output"]
            server.proc.send_signal(signal.SIGTERM)  # to `kiln triton-serve`, which passes it on
            wait_for(lambda: not ready(server), what="the server to stop taking new requests")
            text += "".join(json.loads(line[6:])["text_output"] for line in lines if line.startswith("data: "))
    assert text == ref.text  # the request in flight ran to its end
    assert server.proc.wait(timeout=120) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/v2/health/live", timeout=2)
