"""Online serving benchmark, like vLLM's `benchmark_serving`: streams requests at an OpenAI-compatible
server (/v1/completions) or at Triton (`--backend triton`: the `ensemble` and/or `tensorrt_llm_bls`
model of a `kiln triton-repo` repository, or of tensorrtllm_backend's; `--backend llmapi`: the one
`tensorrt_llm` model of `kiln triton-repo --layout llmapi`; both over /v2/models/*/generate_stream)
and reports request and output-token throughput and mean/median/p99 of TTFT (time to first token),
TPOT (time per output token after the first) and ITL (inter-token latency, between streamed chunks).

Requests are synthetic and seeded: ShareGPT-like long-tailed (log-normal) prompt and output lengths,
prompts cut from Python's standard library source (what the default model was trained on; --dataset
random draws token ids instead, for a model whose tokenizer the source means nothing to), sent as
token ids (--text_prompts sends text) with `ignore_eos` so that each request generates its length
(Triton: text, with `end_id` -1, or llmapi's `sampling_param_ignore_eos`, which generate exactly
`max_tokens`: the output length counted is the one asked for). Load is fixed concurrency
(--concurrency, a sweep: one run per value) or a Poisson --request_rate.

--shared_prefix_len N gives every prompt the same N-token system prompt before its own user turn
(chat and agent traffic), and --prefix_caching on off runs each server twice, with and without
(`kiln serve --no-enable-prefix-caching`, Triton's `enable_kv_cache_reuse=false`), in one invocation.
The table's "cached" column is the share of prompt tokens the server found in its prefix cache, from
each response's `usage.prompt_tokens_details.cached_tokens` (kiln serve, vLLM); the warm-up request
before each run puts the system prompt in the cache, as earlier traffic would.

  # start `kiln serve` on the engine, sweep concurrency, compare with HF transformers one at a time
  python benchmarks/serving.py --engine_dir demo_out/engine --concurrency 1 4 16 64 \\
      --hf_baseline models/kiln-tiny-stdlib --json bench_out/serving.json --plot bench_out/serving.png
  # kiln serve against LLM.generate on the same requests, as many at once as the concurrency
  python benchmarks/serving.py --engine_dir demo_out/engine --concurrency 16 64 --offline
  # any OpenAI-compatible server (vLLM, TensorRT-LLM, Kiln) already running
  python benchmarks/serving.py --base_url http://127.0.0.1:8000 --tokenizer path/to/hf_dir --request_rate 4
  # kiln serve, then Triton's ensemble and BLS models on the same engine, one after the other
  python benchmarks/serving.py --engine_dir demo_out/engine --backend openai triton \\
      --triton_models ensemble tensorrt_llm_bls --concurrency 1 4 16
  # 16 requests sharing a 1,024-token system prompt, with and without prefix caching (an engine
  # that takes such prompts: the demo engine's max_input_len is 256)
  convert_checkpoint --model_dir models/kiln-tiny-stdlib --output_dir bench_out/ckpt_bf16 --dtype bfloat16
  engine-build --checkpoint_dir bench_out/ckpt_bf16 --output_dir bench_out/engine_1k --max_batch_size 16 \\
      --max_input_len 1152 --max_seq_len 1280 --max_num_tokens 2048
  python benchmarks/serving.py --engine_dir bench_out/engine_1k --shared_prefix_len 1024 --input_len 64 \\
      --output_len 32 --num_prompts 16 --concurrency 1 16 --prefix_caching on off
"""
import argparse
import asyncio
import glob
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kiln.utils import free_ports


@dataclass
class Result:
    ok: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache, if it says


# ---------------------------------------------------------------------------------- workload
def make_requests(tokenizer, n: int, input_len: int, output_len: int, max_input: int, max_seq: int,
                  seed: int, shared_prefix_len: int = 0, dataset: str = "stdlib") -> list[tuple[list[int], int]]:
    """n (prompt ids, output length) pairs: log-normal lengths around the given medians (ShareGPT's
    shape: most requests short, a long tail), clipped to the server's limits; with a shared prefix,
    each prompt is the same system prompt of that many tokens and then its own user turn.

    dataset: "stdlib", windows of Python's standard library source; "random", token ids drawn
    uniformly from the vocabulary, apart from special tokens (vLLM's random dataset: for a tokenizer
    the source means nothing to, whose windows would all be the same unknown token and be served
    from the prefix cache)."""
    if shared_prefix_len and shared_prefix_len + 4 > max_input:
        sys.exit(f"--shared_prefix_len {shared_prefix_len} leaves no room for a user turn: the server's longest "
                 f"prompt is {max_input} tokens (--max_input_len, or an engine built with a larger one)")
    rng = np.random.default_rng(seed)
    if dataset == "random":
        special = set(tokenizer.all_special_ids)
        vocab = np.array([i for i in range(len(tokenizer)) if i not in special])
        corpus = rng.choice(vocab, 1 << 20).tolist()
    else:
        files = sorted(glob.glob(str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")))
        corpus = tokenizer.encode("\n".join(Path(f).read_text(errors="replace") for f in files[:12]))
    ins = np.clip(rng.lognormal(np.log(input_len), 0.8, n).astype(int), 4, max_input - shared_prefix_len)
    outs = rng.lognormal(np.log(output_len), 0.7, n).astype(int)
    start = int(rng.integers(0, len(corpus) - shared_prefix_len)) if shared_prefix_len else 0
    system = corpus[start:start + shared_prefix_len]
    requests = []
    for i, o in zip(ins, outs):
        start = int(rng.integers(0, len(corpus) - i))
        prompt = system + corpus[start:start + i]
        requests.append((prompt, int(np.clip(o, 2, max_seq - len(prompt)))))
    return requests


def as_text(tokenizer, requests, max_input: int, max_seq: int) -> list[tuple[list[int], int]]:
    """Each prompt as the ids its text encodes to (they may differ from the ids it was decoded from),
    within the limits: the same prompts whether a backend is sent token ids or text (Triton)."""
    out = []
    for ids, n in requests:
        while True:
            again = tokenizer.encode(tokenizer.decode(ids, skip_special_tokens=True))
            if len(again) <= max_input:
                break
            ids = ids[:-1]
        out.append((again, min(n, max_seq - len(again))))
    return out


# ---------------------------------------------------------------------------------- the client
async def send(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> Result:
    r = Result(prompt_len=prompt_len)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    r.output_len = chunk["usage"]["completion_tokens"]
                    r.prompt_len = chunk["usage"]["prompt_tokens"]
                    r.cached_tokens = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                chunks += 1
                if r.ttft == 0.0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
        r.latency = time.perf_counter() - start
        r.output_len = r.output_len or chunks  # a server without stream_options: one chunk per token
        r.ok = r.output_len > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def send_triton(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int) -> Result:
    """One generate_stream request: each SSE event carries the text of the tokens since the last (the
    llmapi layout: all text so far)."""
    r = Result(prompt_len=prompt_len)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    r.error = event["error"][:200]
                    return r
                if not event.get("text_output"):
                    continue
                now = time.perf_counter()
                if r.ttft == 0.0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
        r.latency = time.perf_counter() - start
        # end_id -1 / ignore_eos: nothing ends a request before max_tokens
        r.output_len = body.get("max_tokens") or body["sampling_param_max_tokens"]
        r.ok = r.ttft > 0
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_load(base_url: str, model: str, requests, concurrency: int | None, rate: float,
                   api_key: str | None, text_prompts: bool, tokenizer, seed: int,
                   backend: str = "openai", warmup: tuple[list[int], int] | None = None) -> tuple[list[Result], float]:
    url = f"{base_url}/v1/completions" if backend == "openai" else f"{base_url}/v2/models/{model}/generate_stream"
    sender = send if backend == "openai" else send_triton
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency or len(requests), max_keepalive_connections=concurrency)
    gate = asyncio.Semaphore(concurrency or len(requests))
    rng = np.random.default_rng(seed)

    def body(ids, out):
        if backend == "triton":
            return {"text_input": tokenizer.decode(ids, skip_special_tokens=True), "max_tokens": out,
                    "stream": True, "end_id": -1}
        if backend == "llmapi":
            return {"text_input": tokenizer.decode(ids, skip_special_tokens=True), "sampling_param_max_tokens": out,
                    "streaming": True, "sampling_param_ignore_eos": True,
                    "sampling_param_exclude_input_from_output": True}
        prompt = tokenizer.decode(ids, skip_special_tokens=True) if text_prompts else ids
        return {"model": model, "prompt": prompt, "max_tokens": out, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}

    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=httpx.Timeout(600)) as client:
        async def one(ids, out):
            async with gate:
                return await sender(client, url, body(ids, out), len(ids))

        await one(*(warmup or requests[0]))  # warm-up: connections, first-step costs
        start = time.perf_counter()
        tasks = []
        for ids, out in requests:
            tasks.append(asyncio.create_task(one(ids, out)))
            if rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


# ------------------------------------------------------------------------------ HF baseline
def run_hf(hf_dir: str, dtype: str, requests, threads: int | None) -> tuple[list[Result], float]:
    """The same requests one at a time through HF transformers' generate (greedy, exact lengths)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    if threads:
        torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):  # first call: the prompt; then one call per new token
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def generate(ids, out) -> Result:
        clock = Clock()
        x = torch.tensor([ids])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=out,
                           min_new_tokens=out, pad_token_id=0, streamer=clock)
        t = clock.times[1:]
        return Result(ok=True, prompt_len=len(ids), output_len=out, ttft=t[0] - start,
                      latency=time.perf_counter() - start, itl=list(np.diff(t)))

    generate(*requests[0])  # warm-up
    start = time.perf_counter()
    results = [generate(ids, out) for ids, out in requests]
    return results, time.perf_counter() - start


def run_offline(engine_dir: str, requests, batch: int | None, threads: int | None) -> tuple[list[Result], float]:
    """The same requests through LLM.generate in this process, at most `batch` at once (the serving
    run's concurrency): what the engine does when no frontend, HTTP or client stands in between."""
    from kiln import LLM, SamplingParams

    llm = LLM(engine_dir, threads=threads, max_batch_size=batch)
    params = [SamplingParams(temperature=0, max_tokens=out, ignore_eos=True) for _, out in requests]
    llm.generate([{"prompt_token_ids": requests[0][0]}], params[:1])  # warm-up
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in requests], params)
    duration = time.perf_counter() - start
    llm.llm_engine.shutdown()
    results = []
    for (ids, out), o in zip(requests, outs, strict=True):
        m = o.metrics
        n = len(o.outputs[0].token_ids)
        tpot = m.time_per_output_token
        itl = [tpot] * (n - 1) if tpot is not None else []
        results.append(Result(ok=n == out, prompt_len=len(ids), output_len=n, ttft=m.time_to_first_token,
                              latency=m.finished_time - m.arrival_time, itl=itl))
    return results, duration


# ---------------------------------------------------------------------------------- report
def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itl = [x for r in ok for x in r.itl]
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
         "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
         "total_token_throughput": (out_tokens + sum(r.prompt_len for r in ok)) / duration,
         "total_output_tokens": out_tokens, "errors": sorted({r.error for r in results if r.error})[:5]}
    told = [r for r in ok if r.cached_tokens is not None]
    if told:  # prefill the server computed, and the share of prompt tokens it took from its cache
        s["prefill_tokens_computed"] = sum(r.prompt_len - r.cached_tokens for r in told)
        s["prefix_cache_hit_rate"] = sum(r.cached_tokens for r in told) / max(sum(r.prompt_len for r in told), 1)
    for name, xs in (("ttft", [r.ttft for r in ok]), ("tpot", tpot), ("itl", itl),
                     ("e2el", [r.latency for r in ok])):
        xs = np.array(xs or [np.nan]) * 1e3
        s.update({f"mean_{name}_ms": float(np.mean(xs)), f"median_{name}_ms": float(np.median(xs)),
                  f"p99_{name}_ms": float(np.percentile(xs, 99))})
    return s


def table(runs: list[dict]) -> str:
    cols = ["load", "req/s", "out tok/s", "TTFT mean/med/p99 ms", "TPOT mean/med/p99 ms", "ITL mean/med/p99 ms",
            "cached"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        trio = [f"{r[f'mean_{m}_ms']:.1f} / {r[f'median_{m}_ms']:.1f} / {r[f'p99_{m}_ms']:.1f}"
                for m in ("ttft", "tpot", "itl")]
        fail = f" ({r['failed']} failed)" if r["failed"] else ""
        hit = r.get("prefix_cache_hit_rate")
        lines.append(f"| {r['label']}{fail} | {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | "
                     + " | ".join(trio) + f" | {'-' if hit is None else f'{100 * hit:.0f}%'} |")
    return "\n".join(lines)


def caching_effect(runs: list[dict]) -> list[str]:
    """Each run with prefix caching against the same run without: TTFT and prefill computed."""
    lines = []
    for on in (r for r in runs if r.get("prefix_caching") == "on"):
        off = next((r for r in runs if r.get("prefix_caching") == "off" and r["server"] == on["server"]
                    and r["concurrency"] == on["concurrency"]), None)
        if off is None or not off["completed"] or not on["completed"]:
            continue
        line = (f"{on['label']}: mean TTFT {on['mean_ttft_ms']:.1f} ms vs {off['mean_ttft_ms']:.1f} ms without "
                f"({off['mean_ttft_ms'] / on['mean_ttft_ms']:.2f}x)")
        if on.get("prefill_tokens_computed") is not None and off.get("prefill_tokens_computed"):
            line += (f"; prefill computed {on['prefill_tokens_computed']} vs {off['prefill_tokens_computed']} "
                     f"tokens ({100 * (1 - on['prefill_tokens_computed'] / off['prefill_tokens_computed']):.0f}% "
                     "fewer)")
        lines.append(line)
    return lines


def plot(runs: list[dict], hf: dict | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [r for r in runs if r.get("concurrency")]
    if not sweep:
        return
    targets = list(dict.fromkeys(r.get("target", "kiln serve") for r in sweep))
    keys = [("median_ttft_ms", "o-"), ("p99_ttft_ms", "o:"), ("median_tpot_ms", "s-"), ("p99_itl_ms", "s:")]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for target in targets:
        rs = [r for r in sweep if r.get("target", "kiln serve") == target]
        x = [r["concurrency"] for r in rs]
        a.plot(x, [r["output_throughput"] for r in rs], "o-", label=target)
        for key, style in keys if len(targets) == 1 else keys[::2]:
            name = key.replace("_ms", "").replace("_", " ")
            b.plot(x, [r[key] for r in rs], style, label=name if len(targets) == 1 else f"{target}: {name}")
    if hf:
        a.axhline(hf["output_throughput"], color="gray", ls="--", label="HF transformers, one at a time")
    ticks = sorted({r["concurrency"] for r in sweep})
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="Throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ms", title="Latency")
    for ax in (a, b):
        ax.set_xticks(ticks, [str(c) for c in ticks])
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------------------------- server
def start_server(engine_dir: str, threads: int | None, log: Path, backend: str = "openai",
                 prefix_caching: bool = True) -> tuple[subprocess.Popen, str]:
    """`kiln serve` (openai), or `kiln triton-repo` + `kiln triton-serve` (triton, llmapi), on the engine."""
    kiln = str(Path(sys.executable).parent / "kiln")
    port, grpc_port, metrics_port = free_ports(3)
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    log.parent.mkdir(parents=True, exist_ok=True)
    if backend == "openai":
        cmd = [kiln, "serve", "--engine_dir", engine_dir, "--host", "127.0.0.1", "--port", str(port),
               "--no_access_log", "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching"] \
            + (["--threads", str(threads)] if threads else [])
        health = "/health"
    else:
        repo = log.parent / f"triton_repo_{backend}"
        subprocess.run([kiln, "triton-repo", "--engine_dir", engine_dir, "--output_dir", str(repo), "--overwrite",
                        "--layout", "llmapi" if backend == "llmapi" else "inflight_batcher_llm",
                        "--param", "batch_scheduler_policy=max_utilization",
                        "--param", "enable_chunked_context=true",
                        "--param", f"enable_kv_cache_reuse={str(prefix_caching).lower()}"],
                       check=True)
        cmd = [kiln, "triton-serve", "--model_repo", str(repo), "--address", "127.0.0.1", "--http-port", str(port),
               "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)]
        health = "/v2/health/ready"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{cmd[1]} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"{url}{health}", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"{cmd[1]} did not become ready in 600 s; see {log}")


def cpu() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma"))]
    return f"{model}, {os.cpu_count()} CPUs, {' '.join(simd) or 'no AVX'}; load average {os.getloadavg()[0]:.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base_url", help="a server already running, e.g. http://127.0.0.1:8000 (one --backend)")
    where.add_argument("--engine_dir", help="start the servers on this engine, one after the other (and stop them)")
    ap.add_argument("--backend", nargs="+", choices=["openai", "triton", "llmapi"], default=["openai"],
                    help="openai: /v1/completions (kiln serve); triton: generate_stream of --triton_models; "
                    "llmapi: generate_stream of the llmapi layout's tensorrt_llm")
    ap.add_argument("--triton_models", nargs="+", default=["ensemble"], choices=["ensemble", "tensorrt_llm_bls"])
    ap.add_argument("--model", help="OpenAI model name to send (default: the server's first in /v1/models)")
    ap.add_argument("--api_key")
    ap.add_argument("--tokenizer", help="HF tokenizer dir (default: the engine dir)")
    ap.add_argument("--num_prompts", type=int, default=200, help="requests per run (at least 2 x concurrency)")
    ap.add_argument("--dataset", choices=["stdlib", "random"], default="stdlib",
                    help="prompts cut from the standard library's source, or random token ids")
    ap.add_argument("--input_len", type=int, default=96, help="median prompt length (log-normal)")
    ap.add_argument("--output_len", type=int, default=128, help="median output length (log-normal)")
    ap.add_argument("--max_input_len", type=int, help="longest prompt (default: the engine's, or half the "
                    "server's max_model_len)")
    ap.add_argument("--max_seq_len", type=int, help="Triton at --base_url: the engine's max_seq_len (default 2048)")
    ap.add_argument("--concurrency", type=int, nargs="+", help="fixed-concurrency runs (a sweep)")
    ap.add_argument("--request_rate", type=float, default=float("inf"), help="Poisson arrivals per second "
                    "(with no --concurrency: one run at this rate)")
    ap.add_argument("--text_prompts", action="store_true", help="send text, not token ids (Triton always does)")
    ap.add_argument("--shared_prefix_len", "--shared-prefix-len", type=int, default=0,
                    help="tokens of a system prompt every prompt starts with (then its own --input_len turn)")
    ap.add_argument("--prefix_caching", "--prefix-caching", nargs="+", choices=["on", "off"],
                    help="with --engine_dir: start each server with prefix caching on and/or off, one run each "
                         "(default: the server's default, on)")
    ap.add_argument("--offline", action="store_true", help="also run each concurrency's requests through "
                    "LLM.generate on --engine_dir, that many at once, and print serving / offline")
    ap.add_argument("--hf_baseline", help="HF model dir: also run the requests one at a time through HF")
    ap.add_argument("--hf_dtype", default=None, help="default: the engine's dtype, else float32")
    ap.add_argument("--hf_num_prompts", type=int, default=None, help="requests for the HF run (default: all)")
    ap.add_argument("--threads", type=int, help="torch threads of the server (and of HF)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if args.base_url and len(args.backend) > 1:
        ap.error("--base_url is one server: give one --backend")
    if args.base_url and args.prefix_caching:
        ap.error("--prefix_caching starts servers: it needs --engine_dir (a server at --base_url has its own setting)")

    from transformers import AutoTokenizer

    print(f"CPU: {cpu()}", file=sys.stderr)
    build = json.loads((Path(args.engine_dir) / "config.json").read_text()) if args.engine_dir else {}
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.engine_dir)
    if args.offline and not args.engine_dir:
        ap.error("--offline runs the engine in this process: it needs --engine_dir")
    runs, model, base_url, offline_runs = [], None, args.base_url, []
    for backend, caching in [(b, c) for b in args.backend for c in args.prefix_caching or [None]]:
        proc = None
        if args.engine_dir:
            log = Path(f"bench_out/serving_{backend}{f'_caching_{caching}' if caching else ''}.log")
            proc, base_url = start_server(args.engine_dir, args.threads, log, backend, caching != "off")
        try:
            if backend == "openai":
                models = httpx.get(f"{base_url}/v1/models", timeout=30, headers={"Authorization": f"Bearer "
                                   f"{args.api_key}"} if args.api_key else {}).json()
                targets = [(args.model or models["data"][0]["id"], "kiln serve" if args.engine_dir else base_url)]
                max_seq = models["data"][0].get("max_model_len") or 2048
            else:
                targets = [(m, f"Triton {m}") for m in args.triton_models] if backend == "triton" else \
                    [("tensorrt_llm", "Triton llmapi")]
                max_seq = build.get("build_config", {}).get("max_seq_len") or args.max_seq_len or 2048
            max_input = args.max_input_len or build.get("build_config", {}).get("max_input_len") or max_seq // 2
            for model, server in targets:
                target = f"{server}, prefix caching {caching}" if caching else server
                for i, c in enumerate(args.concurrency or [None]):
                    n = max(args.num_prompts, 2 * (c or 0))
                    # A seed per run: a server's prefix cache holds the prompts of its earlier runs. The
                    # warm-up is a request of its own (with a shared prefix, it caches the system prompt).
                    requests = make_requests(tokenizer, n + 1, args.input_len, args.output_len, max_input, max_seq,
                                             args.seed + i, args.shared_prefix_len, args.dataset)
                    *requests, warmup = as_text(tokenizer, requests, max_input, max_seq)  # the same for all
                    results, duration = asyncio.run(run_load(base_url, model, requests, c, args.request_rate,
                                                             args.api_key, args.text_prompts, tokenizer, args.seed,
                                                             backend, warmup))
                    label = f"{target}, " + (f"concurrency {c}" if c else f"rate {args.request_rate}/s")
                    runs.append({"label": label, "target": target, "server": server, "concurrency": c,
                                 "prefix_caching": caching, "request_rate": args.request_rate, "num_prompts": n,
                                 **summarize(results, duration)})
                    print(f"{label}: {runs[-1]['completed']}/{n} ok in {duration:.1f}s, "
                          f"{runs[-1]['output_throughput']:.1f} output tok/s", file=sys.stderr)
                    if args.offline:
                        offline_runs.append((runs[-1], requests, c))
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    offline = []
    for run, requests, c in offline_runs:  # after the servers stopped: the machine is the engine's alone
        results, duration = run_offline(args.engine_dir, requests, c, args.threads)
        offline.append({"label": f"LLM.generate, batch {c or 'all'}, same requests as {run['label']}",
                        "concurrency": c, "num_prompts": len(requests), **summarize(results, duration)})
        run["offline"] = offline[-1]
    hf = None
    if args.hf_baseline:
        dtype = args.hf_dtype or build.get("pretrained_config", {}).get("dtype") or "float32"
        requests = make_requests(tokenizer, args.num_prompts + 1, args.input_len, args.output_len, max_input,
                                 max_seq, args.seed, args.shared_prefix_len, args.dataset)  # the first run's
        requests = as_text(tokenizer, requests, max_input, max_seq)[:-1][:args.hf_num_prompts]
        results, duration = run_hf(args.hf_baseline, dtype, requests, args.threads)
        hf = {"label": f"HF transformers ({dtype}), one at a time", "concurrency": None,
              "num_prompts": len(requests), **summarize(results, duration)}
    print(table(runs + offline + ([hf] if hf else [])))
    for line in caching_effect(runs):
        print(line)
    for r in runs:
        if "offline" in r:
            o = r["offline"]
            print(f"{r['label']}: output tok/s {r['output_throughput'] / o['output_throughput']:.2f}x offline's; "
                  f"mean ITL {r['mean_itl_ms']:.1f} ms = {r['mean_itl_ms'] / o['mean_tpot_ms']:.2f}x offline's "
                  f"time per output token ({o['mean_tpot_ms']:.1f} ms)")
    if hf:
        for r in runs:
            print(f"{r['label']}: {r['output_throughput'] / hf['output_throughput']:.2f}x HF's output tok/s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": model, "cpu": cpu(), "args": {
            k: v for k, v in vars(args).items() if not isinstance(v, Path)}, "runs": runs, "hf_baseline": hf},
            indent=2, default=str))
    if args.plot:
        plot(runs, hf, args.plot)
    print(f"{len(runs)} run(s)" + (f"; JSON {args.json}" if args.json else "")
          + (f"; plot {args.plot}" if args.plot else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
