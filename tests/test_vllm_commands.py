"""vLLM's users' own code, verbatim but for the model path: the production guide's `vllm serve` lines
(`kiln serve` in their place) and `LLM(...)` snippets on the default model's Hugging Face dir, built on
first use and cached; vLLM's documented serve invocations (LoRA, several served names, tool calling);
named and required tool_choice without a parser through the `openai` SDK; and the guide's Prometheus
queries evaluated by a real Prometheus scraping `kiln serve` under load. Each command runs in a fresh
subprocess, with an engine cache of the test's own."""
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from conftest import STRICT
from kiln.plugins import cpp
from kiln.utils import free_ports
from test_lora import save_adapter
from test_serve import Server
from test_tools import SCHEMAS, TOOLS

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "kiln-tiny-stdlib"
BIN = Path(sys.executable).parent
HERMES = Path(__file__).with_name("hermes_tools.jinja")
# The guide's lines (its --max-model-len 8192 within the default model's 1,024 positions).
GUIDE_SERVE = [
    "vllm serve {model} --tensor-parallel-size 1 --max-model-len 1024 --gpu-memory-utilization 0.90 "
    "--enable-prefix-caching --dtype auto",
    "vllm serve {model} --max-num-seqs 256 --disable-log-requests",
    'vllm serve {model} --speculative-model "[ngram]" --num-speculative-tokens 5 --ngram-prompt-lookup-max 4',
    "vllm serve {model} --load-format safetensors",
]
GUIDE_LLM = [
    "LLM(model={model!r}, enable_prefix_caching=True, max_model_len=8192)",
    "LLM(model={model!r}, enable_chunked_prefill=True, max_num_batched_tokens=2048)",
    "LLM(model={model!r}, tensor_parallel_size=1, max_model_len=4096, gpu_memory_utilization=0.90, "
    "enable_prefix_caching=True)",
    "LLM(model={model!r}, speculative_model={model!r}, num_speculative_tokens=5)",
]
# vLLM's docs (docs/features/lora.md, serving/openai_compatible_server.md, features/tool_calling.md),
# the model and adapter paths replaced.
VLLM_LORA = ("vllm serve {model} --enable-lora --lora-modules sql-lora={sql} code-lora={code} --max-loras 2 "
             "--max-lora-rank 16")
VLLM_NAMES = "vllm serve {model} --served-model-name my-model other-name"
VLLM_TOOLS_AUTO = "vllm serve {model} --enable-auto-tool-choice --tool-call-parser hermes --chat-template {template}"
VLLM_TOOLS = "vllm serve {model}"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A cache of the test's own for the engines built on first use (the C++ plugins linked from the
    real one, which `make install` built)."""
    root = tmp_path_factory.mktemp("kiln_cache")
    (root / "torch_extensions").symlink_to(cpp.cache_root() / "torch_extensions")
    return dict(os.environ, KILN_CACHE_DIR=str(root), OMP_NUM_THREADS="1")


class Serve(Server):
    """`vllm serve ...` run as `kiln serve ...` on a free port."""

    def __init__(self, line: str, env: dict, log: Path, **paths):
        self.port = free_ports(1)[0]
        self.url = f"http://127.0.0.1:{self.port}"
        argv = shlex.split(line.format(**{k: str(v) for k, v in paths.items()}))
        assert argv[:2] == ["vllm", "serve"]
        self.log = log
        self.proc = subprocess.Popen([str(BIN / "kiln"), "serve", *argv[2:], "--host", "127.0.0.1", "--port",
                                      str(self.port)], stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        self.wait_healthy(timeout=600)  # the first start of a model builds its engine
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0)

    def complete(self, model: str, prompt="def fibonacci(n):", max_tokens: int = 8, **extra) -> str:
        return self.client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                              extra_body=extra or None).choices[0].text

    def stop(self) -> str:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        return self.log.read_text()


def run_python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)


def test_the_guides_serve_lines_and_the_cached_engine(env, tmp_path):
    first = Serve(GUIDE_SERVE[0], env, tmp_path / "first.log", model=MODEL)
    want = first.complete(str(MODEL))
    assert want and "converting and building an engine on first use" in first.stop()

    def one(i_line):
        i, line = i_line
        server = Serve(line, env, tmp_path / f"line{i}.log", model=MODEL)
        try:
            return server.complete(str(MODEL))
        finally:
            log = server.stop()
            assert "on first use" not in log and "the engine built for it before" in log, log[-3000:]

    with ThreadPoolExecutor(2) as pool:  # the first line again: it loads the cached engine
        got = list(pool.map(one, enumerate(GUIDE_SERVE)))
    assert got == [want] * len(GUIDE_SERVE)  # greedy: speculation and the caps change nothing


def test_a_max_model_len_beyond_the_models_positions_is_refused_as_vllm_refuses_it(env):
    proc = subprocess.run([str(BIN / "kiln"), "serve", str(MODEL), "--max-model-len", "8192"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode != 0
    assert "User-specified max_model_len (8192) is greater than the derived max_model_len" in proc.stderr
    proc = subprocess.run([str(BIN / "kiln"), "serve", str(MODEL), "--quantization", "awq"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "is not awq-quantized" in proc.stderr


def test_the_guides_llm_snippets(env):
    """Each in a fresh interpreter. Two ask for a max_model_len past the model's 1,024 positions: refused
    as vLLM refuses them, then generating when its VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 allows them."""
    template = ("from kiln import LLM, SamplingParams\nllm = {snippet}\n"
                "print(repr(llm.generate(['def fibonacci(n):'], SamplingParams(max_tokens=8, temperature=0))[0]"
                ".outputs[0].text))")
    long = {**env, "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"}
    runs = [(s, env) for s in GUIDE_LLM] + [(GUIDE_LLM[0], long), (GUIDE_LLM[2], long)]

    def one(run):
        snippet, environment = run
        return run_python(template.format(snippet=snippet.format(model=str(MODEL))), environment)

    with ThreadPoolExecutor(2) as pool:
        procs = list(pool.map(one, runs))
    refused, ok = [procs[0], procs[2]], [procs[1], procs[3], procs[4], procs[5]]
    assert all(p.returncode != 0 and "VLLM_ALLOW_LONG_MAX_MODEL_LEN" in p.stderr for p in refused)
    assert [p.returncode for p in ok] == [0] * 4, [p.stderr[-2000:] for p in ok]
    texts = {p.stdout.strip().splitlines()[-1] for p in ok}
    assert len(texts) == 1 and texts != {"''"}
    bad = run_python(f"from kiln import LLM\nLLM(model={str(MODEL)!r}, max_num_seq=4)", env)
    assert "TypeError: LLM() got an unexpected keyword argument 'max_num_seq'" in bad.stderr
    assert "max_num_seqs" in bad.stderr.splitlines()[-1]


def test_vllms_lora_invocation(env, tmp_path):
    sql = save_adapter(MODEL, tmp_path / "sql-lora", 8, 16, ["q_proj", "v_proj"], seed=1)
    code = save_adapter(MODEL, tmp_path / "code-lora", 16, 16, ["q_proj", "k_proj", "o_proj", "down_proj"], seed=2)
    server = Serve(VLLM_LORA, env, tmp_path / "lora.log", model=MODEL, sql=sql, code=code)
    try:
        names = {m.id for m in server.client.models.list().data}
        assert {str(MODEL), "sql-lora", "code-lora"} <= names
        base, a, b = (server.complete(m) for m in (str(MODEL), "sql-lora", "code-lora"))
        assert len({base, a, b}) == 3  # each adapter changes what is generated
    finally:
        server.stop()
    # the engine built for the model takes ranks up to 16: served as an engine dir, 64 is refused
    (engine,) = [d for d in (Path(env["KILN_CACHE_DIR"]) / "engines").iterdir()
                 if d.is_dir() and json.loads((d / "config.json").read_text())["build_config"]["lora_config"]]
    proc = subprocess.run([str(BIN / "kiln"), "serve", str(engine), "--enable-lora", "--max-lora-rank", "64",
                           "--lora-modules", f"x={sql}"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode != 0 and "max_lora_rank 64 exceeds the engine's (16)" in proc.stderr


def test_several_served_model_names(env, tmp_path):
    server = Serve(VLLM_NAMES, env, tmp_path / "names.log", model=MODEL)
    try:
        assert [m.id for m in server.client.models.list().data] == ["my-model", "other-name"]
        assert server.complete("my-model") == server.complete("other-name")
    finally:
        server.stop()


def _calls_of(client, choice, stream: bool, parallel: bool):
    kw = dict(model=str(MODEL), messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
              tool_choice=choice, parallel_tool_calls=parallel, max_tokens=120, temperature=0)
    if not stream:
        c = client.chat.completions.create(**kw).choices[0]
        return c.finish_reason, [(t.function.name, t.function.arguments, t.id) for t in c.message.tool_calls or []]
    calls, finish = {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(d.index, [None, "", None])
            entry[0] = d.function.name or entry[0]
            entry[1] += d.function.arguments or ""
            entry[2] = d.id or entry[2]
        finish = chunk.choices[0].finish_reason or finish
    return finish, [tuple(e) for e in calls.values()]


@pytest.mark.parametrize("parallel", [False, True])
def test_named_and_required_tool_choice_without_a_parser(env, tmp_path, parallel):
    server = Serve(VLLM_TOOLS, env, tmp_path / "tools.log", model=MODEL)
    try:
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            results = [_calls_of(server.client, choice, stream, parallel) for stream in (False, True)]
            for finish, calls in results:
                if finish == "length":
                    continue
                assert finish == "tool_calls" and calls and (parallel or len(calls) == 1), (choice, calls)
                for name, arguments, call_id in calls:
                    assert call_id.startswith("call_") and (choice == "required" or name == "get_weather")
                    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            assert [c[:2] for c in results[0][1]] == [c[:2] for c in results[1][1]]  # streamed: the same calls
    finally:
        server.stop()


def test_auto_tool_choice_with_a_parser(env, tmp_path):
    server = Serve(VLLM_TOOLS_AUTO, env, tmp_path / "auto.log", model=MODEL, template=HERMES)
    try:
        r = server.client.chat.completions.create(model=str(MODEL), messages=[{"role": "user", "content": "hi"}],
                                                  tools=TOOLS, max_tokens=16, temperature=0)
        c = r.choices[0]
        assert c.finish_reason in ("stop", "length", "tool_calls")
        assert (c.message.tool_calls is None) == (c.finish_reason != "tool_calls")
    finally:
        server.stop()


# The guide's monitoring: its KEDA trigger, Grafana panels and alert, by vLLM's names.
MODEL_NAME = "kiln-tiny"
KEDA = f'avg(vllm:num_requests_waiting{{model_name="{MODEL_NAME}"}})'
GRAFANA = ["histogram_quantile(0.95, sum(rate(vllm:time_to_first_token_seconds_bucket[1m])) by (le))",
           "vllm:avg_generation_throughput_toks_per_s",
           "vllm:gpu_cache_usage_perc",
           "sum(vllm:num_requests_running)",
           "histogram_quantile(0.99, sum(rate(vllm:e2e_request_latency_seconds_bucket[1m])) by (le))"]
ALERT = "vllm:gpu_cache_usage_perc > 95"


def prometheus() -> Path:
    found = Path(shutil.which("prometheus") or ROOT / ".prometheus" / "usr" / "bin" / "prometheus")
    if not found.is_file():
        message = "Prometheus is not installed (make test unpacks Debian's package into .prometheus/)"
        pytest.fail(message) if STRICT else pytest.skip(message)
    return found


def test_the_guides_prometheus_queries_return_series(env, tmp_path):
    binary = prometheus()
    server = Serve(f"vllm serve {{model}} --served-model-name {MODEL_NAME} --max-num-seqs 2", env,
                   tmp_path / "serve.log", model=MODEL)
    port = free_ports(1)[0]
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 500ms, evaluation_interval: 500ms}\n"
        f"scrape_configs: [{{job_name: kiln-serve, static_configs: [{{targets: ['127.0.0.1:{server.port}']}}]}}]\n")
    prom = subprocess.Popen([str(binary), f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=open(tmp_path / "prometheus.log", "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert prom.poll() is None and time.monotonic() < deadline, (tmp_path / "prometheus.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)

        def query(expr: str) -> list:
            r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query?query={urllib.parse.quote(expr)}", timeout=10)
            return r.json()["data"]["result"]

        def load():  # more requests than batch slots: some wait
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: server.complete(MODEL_NAME, f"import os{i}", 768, ignore_eos=True),
                              range(24)))

        with ThreadPoolExecutor(1) as background:
            running = background.submit(load)
            waiting = []
            while not running.done():
                waiting += [r for r in query(KEDA) if float(r["value"][1]) > 0]
                time.sleep(0.25)
            running.result()
        time.sleep(3)  # a scrape after the load
        assert waiting, "the KEDA trigger never saw a request waiting"
        for expr in [KEDA, *GRAFANA, ALERT.split(" >")[0]]:
            assert query(expr), expr
        # vLLM's usage is a fraction (1 = full), so the guide's "> 95" never fires, on vLLM either
        assert query(ALERT) == [] and query("vllm:gpu_cache_usage_perc <= 1")
    finally:
        prom.terminate()
        prom.wait(timeout=30)
        server.stop()


# vLLM's docs (features/spec_decode.md, EAGLE drafts): the target and draft paths replaced.
VLLM_EAGLE3 = ("vllm serve {model} --speculative-config '{{\"model\": \"{draft}\", \"num_speculative_tokens\": 2, "
               "\"method\": \"eagle3\", \"draft_tensor_parallel_size\": 1}}'")


def test_vllms_eagle3_line(env, tmp_path):
    """The draft is converted and built into the model's engine on first use; greedy completions are the
    plain engine's, and the acceptance counters reach /metrics under vLLM's names."""
    from eagle3_drafts import make_draft

    draft = ROOT / "models" / "kiln-tiny-stdlib-eagle3"
    if not (draft / "config.json").is_file():
        draft = make_draft(tmp_path / "draft", json.loads((MODEL / "config.json").read_text()))
    server = Serve(VLLM_EAGLE3, env, tmp_path / "eagle3.log", model=MODEL, draft=draft)
    try:
        got = server.complete(str(MODEL))
        metrics = httpx.get(f"{server.url}/metrics").text
    finally:
        log = server.stop()
    plain = Serve(GUIDE_SERVE[0], env, tmp_path / "plain.log", model=MODEL)
    try:
        assert got == plain.complete(str(MODEL))
    finally:
        plain.stop()
    assert "the EAGLE-3 draft is converted and built into the model's engine" in log
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0, metrics
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in metrics
