"""`kiln serve` as users meet it: a real server process on loopback, the official `openai` client and
raw HTTP (httpx). Greedy outputs equal `LLM.generate`; 128 concurrent streams complete and leave
every KV block free with counters that add up; a client hanging up frees its request; bad input
gets OpenAI's error schema; SIGTERM under load loses no accepted request (on a server of its own).

Nothing here races the machine's speed: a request meant to be in flight when the test acts asks for
every token the engine allows (`room`), and states are waited for with bounded polls."""
import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from conftest import TEST_BUILD
from kiln import LLM, SamplingParams
from kiln.serve.metrics import METRIC_NAMES, VLLM_METRIC_NAMES
from kiln.utils import free_ports
from tiny_models import PROMPTS

KEY = "test-key"
MODEL = "tiny"
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
BODY_LIMIT = 64 * 1024
MAX_TOKENS = 12
MAX_SEQ_LEN = TEST_BUILD["max_seq_len"]


class Server:
    def __init__(self, engine_dir: Path, log: Path, *args: str):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        kiln = Path(sys.executable).parent / "kiln"
        self.proc = subprocess.Popen(
            [str(kiln), "serve", "--engine_dir", str(engine_dir), "--host", "127.0.0.1", "--port",
             str(self.port), "--no_access_log", "--threads", "1", *args],
            stdout=open(log, "w"), stderr=subprocess.STDOUT)
        self.wait_healthy()

    def wait_healthy(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kiln serve did not become healthy:\n{self.log.read_text()}")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("kiln:"):
                name, value = line.rsplit(" ", 1)
                out[re.sub(r',?model_name="[^"]*"', "", name).replace("{}", "")] = float(value)
        return out

    def wait_for(self, ready, what: str, timeout: float = 60) -> dict[str, float]:
        """Poll /metrics until `ready(metrics)`; the metrics that satisfied it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if ready(m):
                return m
            time.sleep(0.02)
        raise AssertionError(f"timed out waiting for {what}; metrics: {m}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", max_beam_width=4)


@pytest.fixture(scope="module")
def server(engine_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(CHAT_TEMPLATE)
    s = Server(engine_dir, tmp / "server.log", "--api_key", KEY, "--served_model_name", MODEL,
               "--chat_template", str(tmp / "chat.jinja"), "--max_request_body_bytes", str(BODY_LIMIT),
               "--drain_timeout", "60")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def llm(engine_dir):
    return LLM(engine_dir, threads=1)


def room(llm, prompt: str) -> int:
    """The most tokens the engine lets this prompt generate: a request that stays in flight longest."""
    return MAX_SEQ_LEN - len(llm.get_tokenizer().encode(prompt))


def greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", MAX_TOKENS), **kw)


def chat_ids(llm, messages):
    text = llm.get_tokenizer().apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                                   add_generation_prompt=True)
    return llm.get_tokenizer().encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------ basics
def test_health_version_models(server, http):
    assert httpx.get(f"{server.url}/health").status_code == 200  # no key needed for probes
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL] and models["data"][0]["max_model_len"] == MAX_SEQ_LEN


def test_tokenize_detokenize(http, llm):
    tok = llm.get_tokenizer()
    r = http.post("/tokenize", json={"prompt": PROMPTS[1]}).json()
    assert r["tokens"] == tok.encode(PROMPTS[1]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_SEQ_LEN
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == tok.decode(r["tokens"])
    msgs = [{"role": "user", "content": "hi"}]
    assert http.post("/tokenize", json={"messages": msgs}).json()["tokens"] == chat_ids(llm, msgs)


# ------------------------------------------------------------------------ outputs = LLM.generate
def test_completions_equal_llm_generate(client, llm):
    ref = llm.generate(PROMPTS, greedy())
    batch = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS)))
    for choice, r in zip(batch.choices, ref):
        assert choice.text == r.outputs[0].text and choice.finish_reason == r.outputs[0].finish_reason
    assert batch.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in ref)
    assert batch.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in ref)
    for prompt, r in zip(PROMPTS[:3], ref):
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == r.outputs[0].text
        assert [c.choices[0].finish_reason for c in chunks][-1] == r.outputs[0].finish_reason
    # several prompts x n samples in one stream: choice i*n+j carries prompt i's sample j
    texts = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS[:3], n=2, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {i: ref[i // 2].outputs[0].text for i in range(6)}
    # token-id prompts, echo
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_TOKENS, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[0] + ref[0].outputs[0].text


def test_chat_equals_llm_generate(client, llm):
    msgs = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": PROMPTS[1]}]
    ref = llm.generate({"prompt_token_ids": chat_ids(llm, msgs)}, greedy())[0]
    out = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.outputs[0].text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=MAX_TOKENS,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)


def test_logprobs_equal_llm_generate(client, llm):
    ref = llm.generate(PROMPTS[1], greedy(logprobs=3))[0].outputs[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                    logprobs=3).choices[0]
    tok = llm.get_tokenizer()
    assert out.logprobs.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert out.logprobs.token_logprobs == [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]
    # the legacy format keys each entry (the sampled token and the top 3) by the token's text
    assert out.logprobs.top_logprobs == [{tok.decode([t]): v for t, v in lp.items()} for lp in ref.logprobs]
    msgs = [{"role": "user", "content": "x"}]
    chat_ref = llm.generate({"prompt_token_ids": chat_ids(llm, msgs)}, greedy(max_tokens=4, logprobs=2))[0].outputs[0]
    chat = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in content] == [(tok.decode([t]), lp[t])
                                                       for t, lp in zip(chat_ref.token_ids, chat_ref.logprobs)]
    for c, lp in zip(content, chat_ref.logprobs, strict=True):
        top2 = sorted(lp.items(), key=lambda kv: -kv[1])[:2]
        assert [(t.token, t.logprob) for t in c.top_logprobs] == [(tok.decode([t]), v) for t, v in top2]
        assert c.top_logprobs[0].bytes == list(tok.decode([top2[0][0]]).encode("utf-8", errors="replace"))
    # echo + logprobs: the prompt's tokens come first, the first with no logprob
    echo = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0, logprobs=1,
                                     echo=True).choices[0].logprobs
    n_prompt = len(tok.encode(PROMPTS[0]))
    assert len(echo.tokens) == n_prompt + 2 and echo.token_logprobs[0] is None and echo.text_offset[0] == 0


def test_stop_seed_n_penalties(client, llm):
    prompt = PROMPTS[4]
    full = llm.generate(prompt, greedy(max_tokens=40))[0].outputs[0].text
    stop = next(full[i:i + 3] for i in range(3, len(full) - 3) if full[i:i + 3].isascii() and full[i:i + 3].strip())
    ref = llm.generate(prompt, greedy(max_tokens=40, stop=[stop]))[0].outputs[0]
    assert ref.finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=stop)
    assert out.choices[0].text == ref.text and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, stop=[stop],
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == ref.text  # held back text never leaks the stop
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=1.0, n=3, seed=7,
              presence_penalty=0.5, frequency_penalty=0.5, extra_body={"top_k": 20, "repetition_penalty": 1.1})
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 3
    ref = llm.generate(PROMPTS[2], SamplingParams(max_tokens=MAX_TOKENS, n=3, seed=7, presence_penalty=0.5,
                                                  frequency_penalty=0.5, top_k=20, repetition_penalty=1.1))[0]
    assert [c.text for c in a.choices] == [o.text for o in ref.outputs]


def test_beam_search_equals_llm_generate(client, llm):
    """vLLM's beam search fields: best_of beams, the n best returned, streamed or not."""
    beam = dict(use_beam_search=True, length_penalty=0.5, early_stopping=True)
    ref = llm.generate(PROMPTS[2], SamplingParams(n=2, best_of=4, max_tokens=MAX_TOKENS, **beam))[0]
    out = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, n=2, best_of=4,
                                    extra_body=beam)
    assert [c.text for c in out.choices] == [c.text for c in ref.outputs]
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, n=2, best_of=4,
                                       extra_body=beam, stream=True)
    texts = ["", ""]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in ref.outputs]
    messages = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, n=3, extra_body=beam)
    assert len(out.choices) == 3 and len({c.message.content for c in out.choices}) == 3  # distinct beams


# ------------------------------------------------------------------------------- under load
def test_128_concurrent_streams(server, llm):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS) % 3) for i in range(128)]
    ref = {p: o.outputs[0].text for p, o in zip(prompts, llm.generate(prompts, greedy(max_tokens=8)))}
    before = server.metrics()

    async def one(client, prompt):
        text, usage = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert [t for t, _ in results] == [ref[p] for p in prompts]
    after = server.metrics()
    assert after["kiln:num_requests_running"] == after["kiln:num_requests_waiting"] == 0
    assert after["kiln:kv_cache_free_blocks"] == after["kiln:kv_cache_total_blocks"] > 0
    assert after["kiln:kv_cache_usage_perc"] == 0

    def delta(name):
        return after[name] - before.get(name, 0)

    done = sum(delta(f'kiln:request_success_total{{finished_reason="{r}"}}') for r in ("stop", "length", "abort"))
    assert done == 128 and delta("kiln:e2e_request_latency_seconds_count") == 128
    assert delta("kiln:prompt_tokens_total") == sum(u.prompt_tokens for _, u in results)
    assert delta("kiln:generation_tokens_total") == sum(u.completion_tokens for _, u in results)
    assert delta("kiln:time_to_first_token_seconds_count") == 128
    # the same prompts come back (prefix caching is on): their full blocks are found, never more
    assert delta("kiln:prefix_cache_queries_total") == delta("kiln:prompt_tokens_total")
    assert 0 < delta("kiln:prefix_cache_hits_total") < delta("kiln:prefix_cache_queries_total")
    assert sum(u.prompt_tokens_details.cached_tokens for _, u in results) == delta("kiln:prefix_cache_hits_total")
    exported = {re.sub(r"_(bucket|count|sum)$", "", name.split("{")[0]) for name in after}
    assert set(METRIC_NAMES) <= exported  # the names deploy/ and dashboards rely on
    # and each under vLLM's name (with its older ones), the same values: --metrics-names both
    raw = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in
           httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines() if line[:5] in ("kiln:", "vllm:")}
    assert set(VLLM_METRIC_NAMES) <= {re.sub(r"_(bucket|count|sum)$", "", n.split("{")[0]) for n in raw}
    assert all(raw["vllm:" + n[5:]] == v for n, v in raw.items() if n.startswith("kiln:"))


def send_raw(server, path: str, body: dict) -> socket.socket:
    """A request written on a socket of our own, so that the test decides when the client hangs up."""
    data = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def test_disconnect_mid_stream_frees_blocks(server, http, llm):
    max_tokens = room(llm, PROMPTS[0])  # in flight for every step the engine allows it
    before = server.metrics()
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # three events, each followed by a blank line
        assert got[0].startswith("data: ")
        mid = server.metrics()
        assert mid["kiln:num_requests_running"] == 1 and mid["kiln:kv_cache_usage_perc"] > 0
    abort = 'kiln:request_success_total{finished_reason="abort"}'
    idle = lambda m: m["kiln:num_requests_running"] == 0 and m["kiln:kv_cache_usage_perc"] == 0  # noqa: E731
    m = server.wait_for(idle, "the closed stream's request to leave the engine")
    assert m[abort] == before[abort] + 1
    # a non-streaming client that hangs up while its request is in the engine is aborted too
    conn = send_raw(server, "/v1/completions", {**body, "stream": False})
    server.wait_for(lambda m: m["kiln:num_requests_running"] == 1, "the non-streaming request to run")
    conn.close()
    m = server.wait_for(idle, "the aborted request to leave the engine")
    assert m["kiln:kv_cache_free_blocks"] == m["kiln:kv_cache_total_blocks"]
    assert m[abort] == before[abort] + 2
    assert m["kiln:generation_tokens_total"] - before["kiln:generation_tokens_total"] < 2 * max_tokens


# ------------------------------------------------------------------------------- bad input
def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "type" in err and "param" in err
    return err


@pytest.mark.parametrize("body, status, param", [
    ({"prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
    ({"prompt": "x " * 300, "max_tokens": 4}, 400, "prompt"),  # over max_input_len (128)
    ({"prompt": "x", "n": 9}, 400, "n"),  # over max_batch_size (8)
    ({"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": [1, 2, 999]}, 400, "prompt"),  # outside the vocabulary
    ({"prompt": ""}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"prompt": "x", "use_beam_search": True, "n": 2, "top_p": 0.5}, 400, "use_beam_search"),
    ({"prompt": "x", "best_of": 3}, 400, "best_of"),
    ({"prompt": "x", "use_beam_search": True, "n": 8}, 400, None),  # over max_beam_width (4)
])
def test_bad_completions(http, body, status, param):
    err = error_of(http.post("/v1/completions", json={"model": MODEL, **body}), status)
    assert err["param"] == param


def test_bad_requests_keep_the_server_serving(server, http, client):
    error_of(http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400)
    error_of(http.post("/v1/chat/completions", json={"messages": [], "model": MODEL}), 400)
    error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                    "top_logprobs": 2}), 400)
    error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x " * 300}]}), 400)
    error_of(http.post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 1)}), 413)

    def chunked():  # no Content-Length: the limit is counted as the body arrives
        for _ in range(BODY_LIMIT // 1024 + 2):
            yield b" " * 1024
    error_of(http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"}), 413)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        err = error_of(httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="max_seq_len"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1000)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2).choices[0].finish_reason
    assert httpx.get(f"{server.url}/health").status_code == 200


# ------------------------------------------------------------------- benchmarks/serving.py
def test_serving_benchmark_smoke(server, llm, hf_model, tmp_path):
    """The load generator against this server (a few requests), its HF baseline, report and plot."""
    import importlib.util

    path = Path(__file__).parent.parent / "benchmarks" / "serving.py"
    spec = importlib.util.spec_from_file_location("bench_serving", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = llm.get_tokenizer()
    requests = bench.make_requests(tok, 6, 16, 8, max_input=TEST_BUILD["max_input_len"], max_seq=MAX_SEQ_LEN, seed=0)
    assert requests == bench.make_requests(tok, 6, 16, 8, max_input=TEST_BUILD["max_input_len"], max_seq=MAX_SEQ_LEN, seed=0)  # seeded
    rand = bench.make_requests(tok, 6, 16, 8, max_input=TEST_BUILD["max_input_len"], max_seq=MAX_SEQ_LEN, seed=0,
                               dataset="random")
    assert len({tuple(p[:4]) for p, _ in rand}) == 6  # no two begin alike
    assert not {t for p, _ in rand for t in p} & set(tok.all_special_ids)
    runs = []
    for c in (1, 4):
        results, duration = asyncio.run(bench.run_load(server.url, MODEL, requests, c, float("inf"), KEY,
                                                        False, tok, 0))
        assert [r.output_len for r in results] == [out for _, out in requests], [r.error for r in results]
        runs.append({"label": f"concurrency {c}", "concurrency": c, **bench.summarize(results, duration)})
    hf_results, hf_duration = bench.run_hf(str(hf_model("llama")), "float32", requests[:2], 1)
    hf = {"label": "hf", **bench.summarize(hf_results, hf_duration)}
    assert hf["completed"] == 2 and all(r["completed"] == 6 and r["mean_ttft_ms"] > 0 for r in runs)
    assert "concurrency 4" in bench.table(runs + [hf])
    bench.plot(runs, hf, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


# ------------------------------------------------------------------ SIGTERM, on its own server
def test_sigterm_under_load_loses_no_request(engine_dir, llm, tmp_path):
    """16 requests on a batch of 2: when SIGTERM comes, 2 run and the rest wait, each asking for
    every token it may have, so the drain has several rounds of work left whatever the speed."""
    server = Server(engine_dir, tmp_path / "server.log", "--api_key", KEY, "--served_model_name", MODEL,
                    "--max_batch_size", "2", "--drain_timeout", "120")
    try:
        _sigterm_under_load(server, llm)
    finally:
        server.stop()


def _sigterm_under_load(server: Server, llm) -> None:
    n = 16
    prompts = [PROMPTS[(0, 1, 4)[i % 3]] for i in range(n)]
    max_tokens = min(room(llm, p) for p in prompts)
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {KEY}"}
    done = 'kiln:request_success_total{finished_reason="length"}'

    async def one(client, prompt):
        usage, reason = None, None
        async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    reason = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), reason)
        return usage, reason

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=120) as client:
            before = (await asyncio.to_thread(server.metrics)).get(done, 0)
            tasks = [asyncio.create_task(one(client, p)) for p in prompts]
            # every request accepted (running, waiting or already done: a count that only grows)
            m = await asyncio.to_thread(server.wait_for, lambda m: m["kiln:num_requests_running"]
                                        + m["kiln:num_requests_waiting"] + m.get(done, 0) - before == n,
                                        "every request to be accepted")
            assert m["kiln:num_requests_waiting"] > 0
            os.kill(server.proc.pid, signal.SIGTERM)
            async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=10) as probe:
                for _ in range(500):  # draining: still listening, /health 503, new work refused
                    if (await probe.get("/health")).status_code == 503:
                        break
                    await asyncio.sleep(0.02)
                health = await probe.get("/health")
                refused = await probe.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            running = sum(not t.done() for t in tasks)
            return await asyncio.gather(*tasks), health, refused, running

    results, health, refused, running = asyncio.run(main())
    assert health.status_code == 503 and running > 0
    error_of(refused, 503)
    assert server.proc.wait(timeout=120) == 0
    assert [(u["completion_tokens"], reason) for u, reason in results] == [(max_tokens, "length")] * n
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{server.url}/health", timeout=2)
    log = server.log.read_text()
    assert "SIGTERM: draining" in log and "drain timeout" not in log


# --------------------------------------------------------------------- a dead engine core
def test_killed_engine_core_fails_fast(engine_dir, llm, tmp_path):
    """The engine core runs in a process of its own: killing it fails the stream in flight, turns
    /health 503 and makes the server exit non-zero (so that Kubernetes restarts it), in seconds."""
    import psutil

    server = Server(engine_dir, tmp_path / "server.log", "--api_key", KEY, "--served_model_name", MODEL)
    try:
        (core,) = [p for p in psutil.Process(server.proc.pid).children() if "kiln.runtime.core.core_process" in p.cmdline()]
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": room(llm, PROMPTS[0]), "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            core.kill()
            killed = time.monotonic()
            rest = list(lines)  # the stream ends, with an error event, instead of hanging
        assert any("server_error" in line for line in rest) and rest[-2:] == ["data: [DONE]", ""]
        health = []
        while server.proc.poll() is None and time.monotonic() - killed < 10:
            try:
                health.append(httpx.get(f"{server.url}/health", timeout=1).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert server.proc.wait(timeout=max(0.1, 10 - (time.monotonic() - killed))) == 1
        assert 200 not in health
        assert "the engine core" in server.log.read_text()
    finally:
        server.stop()
