"""`kiln triton-repo --layout llmapi`: TensorRT-LLM's single-model layout (one text-in, text-out
`tensorrt_llm` configured by model.yaml) on a real tritonserver, driven as end_to_end_test.py
--test-llmapi drives it: generate and generate_stream equal LLM.generate's text, cancellation by a
closed stream, a cancelled gRPC stream or a `stop` request frees the engine's blocks, perf metrics,
bad input named; model.yaml's keys checked; a non-decoupled repository answers once."""
import asyncio
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from kiln import LLM, SamplingParams
from kiln.cli import cli
from kiln.triton_backend.llmapi_io import ModelYamlError, read_model_yaml
from kiln.triton_backend.repository import check_repository
from tiny_models import PROMPTS
from triton_client import Stream, Triton, grpc_inputs, idle, sse

ROOT = Path(__file__).parent.parent
MAX_TOKENS = 12
LONG = 900


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", max_seq_len=1024)  # the engine tests/test_triton.py serves: built once


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, threads=1)


def write(engine_dir, out, *params) -> None:
    args = ["triton-repo", "--layout", "llmapi", "--engine_dir", str(engine_dir), "--output_dir", str(out)]
    for p in params:
        args += ["--param", p]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    repo = tmp_path_factory.mktemp("llmapi") / "repo"
    write(engine_dir, repo, "cancellation_check_period_ms=10", "batch_scheduler_policy=max_utilization")
    s = Triton(repo, tmp_path_factory.mktemp("llmapi_log") / "server.log")
    yield s
    s.stop()


def reference(llm, prompt: str, max_tokens: int = MAX_TOKENS):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0].outputs[0]


def test_generate_and_generate_stream_equal_llm_generate(server, llm):
    ref = reference(llm, PROMPTS[2])
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v2/models/tensorrt_llm/generate", json={
            "text_input": PROMPTS[2], "sampling_param_max_tokens": MAX_TOKENS, "return_finish_reason": True,
            "sampling_param_exclude_input_from_output": True})
        assert r.status_code == 200, r.text
        assert r.json()["text_output"] == ref.text and r.json()["finish_reason"] == "length"
        # the prompt's text first unless excluded, as TensorRT-LLM's llmapi model
        r = http.post("/v2/models/tensorrt_llm/generate", json={"text_input": PROMPTS[2],
                                                                 "sampling_param_max_tokens": MAX_TOKENS})
        assert r.json()["text_output"] == PROMPTS[2] + ref.text
        events = sse(http, "tensorrt_llm", {"text_input": PROMPTS[2], "sampling_param_max_tokens": MAX_TOKENS,
                                            "streaming": True, "sampling_param_exclude_input_from_output": True,
                                            "return_finish_reason": True, "return_cumulative_logprob": True})
    texts = [e["text_output"] for e in events]
    assert len(texts) > 1 and texts[-1] == ref.text
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # each response: the whole text so far
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + ["length"]
    assert float(events[-1]["cumulative_logprob"]) < 0


def test_grpc_stream_with_sampling_params_and_perf_metrics(server, llm):
    """What end_to_end_test.py --test-llmapi --streaming sends (text_input of shape [1]), with the
    perf metrics' outputs in their declared types."""
    ref = reference(llm, PROMPTS[1], 6)
    stream = Stream(server)
    try:
        stream.send("tensorrt_llm", grpc_inputs(
            text_input=np.array([PROMPTS[1].encode()], object), streaming=np.array([True]),
            sampling_param_max_tokens=np.array([6], np.int32), sampling_param_top_k=np.array([1], np.int32),
            sampling_param_exclude_input_from_output=np.array([True]),
            sampling_param_return_perf_metrics=np.array([True]), return_stop_reason=np.array([True])))
        responses = stream.responses()
    finally:
        stream.close()
    last = responses[-1]
    assert last.as_numpy("text_output")[0].decode() == ref.text
    assert last.as_numpy("stop_reason")[0] == b"None"
    assert last.as_numpy("kv_cache_alloc_total_blocks").dtype == np.int32
    assert 0 < last.as_numpy("arrival_time_ns")[0] <= last.as_numpy("first_token_time_ns")[0] \
        <= last.as_numpy("last_token_time_ns")[0]
    assert last.as_numpy("kv_cache_hit_rate")[0] == 0.0 and last.as_numpy("kv_cache_missed_block")[0] >= 1


def _cancel_grpc(server):
    stream = Stream(server)
    stream.send("tensorrt_llm", grpc_inputs(text_input=np.array([PROMPTS[0].encode()], object),
                                            streaming=np.array([True]), sampling_param_max_tokens=np.array(
                                                [LONG], np.int32)))
    stream.get()
    stream.close(cancel=True)


def _close_sse(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        with client.stream("POST", "/v2/models/tensorrt_llm/generate_stream", json={
                "text_input": PROMPTS[0], "sampling_param_max_tokens": LONG, "streaming": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: "))


def _stop_request(server):
    """A `stop` request under the request's id: both get TensorRT-LLM's CANCELLED error."""
    stream = Stream(server)
    try:
        stream.send("tensorrt_llm", grpc_inputs(text_input=np.array([PROMPTS[0].encode()], object),
                                                streaming=np.array([True]),
                                                sampling_param_max_tokens=np.array([LONG], np.int32)),
                    request_id="stop-me")
        stream.get()
        with httpx.Client(base_url=server.url, timeout=120) as client:
            stop = client.post("/v2/models/tensorrt_llm/generate", json={"id": "stop-me", "text_input": "",
                                                                          "stop": True})
        assert "cancelled" in stop.json()["error"]
        with pytest.raises(Exception, match="cancelled"):
            while True:
                stream.get()
    finally:
        stream.close()


@pytest.mark.parametrize("route", ["grpc_cancel", "sse_close", "stop_request"])
def test_cancellation_frees_the_requests_blocks(server, route):
    before = idle(server)
    {"grpc_cancel": _cancel_grpc, "sse_close": _close_sse, "stop_request": _stop_request}[route](server)
    after = idle(server)
    generated = after['nv_llm_output_token_len_sum{response_metric_type="total_output_tokens"}'] - \
        before['nv_llm_output_token_len_sum{response_metric_type="total_output_tokens"}']
    steps = after['nv_trt_llm_general_metrics{general_type="iteration_counter"}'] - \
        before['nv_trt_llm_general_metrics{general_type="iteration_counter"}']
    assert generated < LONG / 3 and steps < LONG / 3, (generated, steps)


def test_serving_benchmark_targets_llmapi(server, llm):
    """benchmarks/serving.py --backend llmapi: streamed requests of exactly max_tokens (ignore_eos)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "benchmarks" / "serving.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = llm.get_tokenizer()
    requests = bench.make_requests(tok, 6, 16, 8, max_input=128, max_seq=1024, seed=0)
    results, duration = asyncio.run(bench.run_load(server.url, "tensorrt_llm", requests, 3, float("inf"), None, True,
                                                    tok, 0, backend="llmapi"))
    assert all(r.ok for r in results), [r.error for r in results]
    assert [r.output_len for r in results] == [out for _, out in requests]
    assert bench.summarize(results, duration)["output_throughput"] > 0
    # ignore_eos: the request runs to max_tokens past the end token
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v2/models/tensorrt_llm/generate", json={
            "text_input": PROMPTS[0], "sampling_param_max_tokens": 40, "sampling_param_ignore_eos": True,
            "return_finish_reason": True})
    assert r.json()["finish_reason"] == "length"


def test_guided_decoding(server):
    """The layout takes the inflight_batcher_llm layout's guided_decoding_guide_type / _guide inputs."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v2/models/tensorrt_llm/generate", json={
            "text_input": "x", "sampling_param_max_tokens": 24, "sampling_param_exclude_input_from_output": True,
            "guided_decoding_guide_type": "regex", "guided_decoding_guide": "[0-9]{2}[a-z]",
            "return_finish_reason": True})
        assert r.status_code == 200 and re.fullmatch("[0-9]{2}[a-z]", r.json()["text_output"]), r.text
        assert r.json()["finish_reason"] == "stop"
        r = http.post("/v2/models/tensorrt_llm/generate", json={"text_input": "x", "guided_decoding_guide_type": "yaml",
                                                                "guided_decoding_guide": "a"})
        assert r.status_code == 400 and "guided_decoding_guide_type 'yaml' is not supported" in r.json()["error"]


@pytest.mark.parametrize("body, message", [
    ({"sampling_param_max_tokens": 4}, "text_input is required"),
    ({"text_input": "x", "sampling_param_best_of": 2}, "sampling_param_best_of 2 is not supported"),
    ({"text_input": "x", "sampling_param_max_tokens": 0}, "sampling_param_max_tokens must be >= 1"),
    ({"text_input": "x", "sampling_param_top_p": 1.5}, "top_p"),
])
def test_bad_input_is_an_error_naming_it(server, body, message):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v2/models/tensorrt_llm/generate", json=body)
        assert r.status_code == 400 and message in r.json()["error"], r.text
        assert http.post("/v2/models/tensorrt_llm/generate", json={"text_input": "x", "sampling_param_max_tokens": 2}
                         ).status_code == 200


def test_model_yaml_keys_are_checked(engine_dir, tmp_path):
    write(engine_dir, tmp_path / "repo")
    path = tmp_path / "repo" / "tensorrt_llm" / "1" / "model.yaml"
    good = yaml.safe_load(path.read_text())
    cfg = read_model_yaml(path)
    assert cfg.engine_dir == engine_dir.resolve() and cfg.decoupled and cfg.max_batch_size == 0
    assert cfg.engine_args == {"enable_chunked_prefill": False, "enable_prefix_caching": True,
                               "scheduler_policy": "guaranteed_no_evict"}
    for change, message in [({"tensor_parallel_size": 2}, "tensor_parallel_size 2: the engine was built for 1"),
                            ({"backend": "pytorch"}, "backend 'pytorch'"),
                            ({"max_seq_len": 9}, "unknown key(s) 'max_seq_len'"),
                            ({"scheduler_config": {"capacity_scheduler_policy": "STATIC"}},
                             "capacity_scheduler_policy"),
                            ({"kv_cache_config": {"dtype": "fp8"}}, "kv_cache_config takes"),
                            ({"model": str(tmp_path)}, "model "),
                            ({"triton_config": {"decoupled": "yes"}}, "triton_config.decoupled must be true or false")]:
        path.write_text(yaml.safe_dump({**good, **change}))
        with pytest.raises(ModelYamlError, match=message.replace("(", r"\(").replace(")", r"\)")):
            read_model_yaml(path)
    path.write_text(yaml.safe_dump({**good, "triton_config": {**good["triton_config"], "decoupled": False}}))
    assert any("decoupled is True in config.pbtxt but False in model.yaml" in p
               for p in check_repository(tmp_path / "repo"))
    result = CliRunner().invoke(cli, ["triton-repo", "--layout", "llmapi", "--engine_dir", str(engine_dir),
                                      "--output_dir", str(tmp_path / "other"), "--param", "add_special_tokens=false"])
    assert result.exit_code != 0 and "add_special_tokens are for the inflight_batcher_llm layout" in result.output
    assert not (tmp_path / "other").exists()


def test_non_decoupled_llmapi_repository(engine_dir, llm, tmp_path):
    """end_to_end_test.py --test-llmapi over HTTP (client.infer): one response per request; streaming
    is refused by name."""
    write(engine_dir, tmp_path / "repo", "decoupled_mode=false")
    server = Triton(tmp_path / "repo", tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            r = http.post("/v2/models/tensorrt_llm/infer", json={"inputs": [
                {"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPTS[3]]},
                {"name": "sampling_param_max_tokens", "shape": [1], "datatype": "INT32", "data": [MAX_TOKENS]},
                {"name": "sampling_param_exclude_input_from_output", "shape": [1], "datatype": "BOOL",
                 "data": [True]}]})
            assert r.status_code == 200, r.text
            assert json.loads(r.text)["outputs"][0]["data"] == [reference(llm, PROMPTS[3]).text]
            r = http.post("/v2/models/tensorrt_llm/generate", json={"text_input": "x", "streaming": True})
            assert r.status_code == 400 and "streaming needs the decoupled model" in r.json()["error"]
    finally:
        server.stop()
