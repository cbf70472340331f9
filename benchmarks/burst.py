"""A burst of concurrent requests next to other CPU users, through the surfaces users serve from.

Each trial sends --requests completions at once (--prompt_len-token prompts, fresh for every request
and trial so the prefix cache serves none of them; --new_tokens each, EOS ignored) and times until
the last one has finished. Surfaces: `kiln serve` (/v1/completions, streamed), Triton (`kiln
triton-repo` + `kiln triton-serve`, the ensemble's generate_stream) and offline `LLM.generate`.
Conditions: quiet, and next to 1 or 2 processes spinning in a pure Python loop (started before the
condition's trials, killed after). Reported per surface and condition: every trial's time, the
median, the worst, and the worst over the surface's quiet median: on a fair share of the CPU a
trial should take at most 1.5-3x its quiet time.

  python benchmarks/burst.py --engine_dir bench_out/engine --json bench_out/burst.json
  python benchmarks/burst.py --engine_dir bench_out/engine --surfaces openai --conditions quiet busy1 --trials 5
"""
import argparse
import asyncio
import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from serving import cpu, send, send_triton, start_server  # noqa: E402

BUSY = {"quiet": 0, "busy1": 1, "busy2": 2}


def source_tokens(tokenizer) -> list[int]:
    """The standard library's source as token ids: text the default model knows."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    text = "\n".join(p.read_text(errors="replace") for p in sorted(lib.glob("*.py"))[:60])
    return tokenizer.encode(text)


def prompts_for(tokens: list[int], n: int, length: int, rng) -> list[list[int]]:
    starts = rng.integers(0, len(tokens) - length, size=n)
    return [tokens[s:s + length] for s in starts]


def start_busy(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def http_trial(client, surface: str, url: str, model: str, tokenizer, prompts, new_tokens: int) -> float:
    if surface == "openai":
        bodies = [{"model": model, "prompt": p, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True, "stream_options": {"include_usage": True}} for p in prompts]
        sender, endpoint = send, f"{url}/v1/completions"
    else:
        bodies = [{"text_input": tokenizer.decode(p, skip_special_tokens=True), "max_tokens": new_tokens,
                   "stream": True, "end_id": -1} for p in prompts]
        sender, endpoint = send_triton, f"{url}/v2/models/ensemble/generate_stream"
    start = time.perf_counter()
    results = await asyncio.gather(*(sender(client, endpoint, b, len(p)) for b, p in zip(bodies, prompts)))
    elapsed = time.perf_counter() - start
    for r in results:
        if not r.ok or r.output_len != new_tokens:
            raise RuntimeError(f"{surface}: a request failed or came back short ({r.output_len} of {new_tokens} "
                               f"tokens): {r.error}")
    return elapsed


def run_http(surface: str, args, tokenizer, tokens, log_dir: Path) -> dict:
    proc, url = start_server(str(args.engine_dir), args.threads, log_dir / f"{surface}.log", backend=surface)
    try:
        model = ""
        if surface == "openai":
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

        async def trials():
            out = {}
            limits = httpx.Limits(max_connections=args.requests, max_keepalive_connections=args.requests)
            async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600)) as client:
                rng = np.random.default_rng(args.seed)
                for _ in range(2):  # warm-up: connections, first-step costs
                    await http_trial(client, surface, url, model, tokenizer,
                                     prompts_for(tokens, args.requests, args.prompt_len, rng), args.new_tokens)
                for condition in args.conditions:
                    out[condition] = await condition_trials(
                        condition, lambda: http_trial(client, surface, url, model, tokenizer,
                                                      prompts_for(tokens, args.requests, args.prompt_len, rng),
                                                      args.new_tokens), args)
            return out

        return asyncio.run(trials())
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def run_offline(args, tokenizer, tokens) -> dict:
    from kiln import LLM, SamplingParams

    llm = LLM(str(args.engine_dir), **({"threads": args.threads} if args.threads else {}))
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    rng = np.random.default_rng(args.seed)

    async def trial():
        batch = [{"prompt_token_ids": p} for p in prompts_for(tokens, args.requests, args.prompt_len, rng)]
        start = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == args.new_tokens for o in outs)
        return elapsed

    async def trials():
        for _ in range(2):
            await trial()
        return {c: await condition_trials(c, trial, args) for c in args.conditions}

    return asyncio.run(trials())


async def condition_trials(condition: str, trial, args) -> list[float]:
    load = start_busy(BUSY[condition])
    try:
        if load:
            await asyncio.sleep(0.5)
        times = []
        for _ in range(args.trials):
            times.append(await trial())
            print(f"  {condition}: {times[-1] * 1e3:.0f} ms", file=sys.stderr, flush=True)
        return times
    finally:
        for p in load:
            p.kill()
            p.wait()


def report(results: dict) -> None:
    print(f"{'surface':<8} {'condition':<9} {'median ms':>9} {'worst ms':>9} {'worst/quiet':>11}  trials (ms)")
    for surface, by_condition in results.items():
        quiet = np.median(by_condition["quiet"]) if "quiet" in by_condition else None
        for condition, times in by_condition.items():
            worst = max(times)
            ratio = f"{worst / quiet:.1f}x" if quiet else "-"
            print(f"{surface:<8} {condition:<9} {np.median(times) * 1e3:>9.0f} {worst * 1e3:>9.0f} {ratio:>11}  "
                  + " ".join(f"{t * 1e3:.0f}" for t in times))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine_dir", type=Path, required=True)
    ap.add_argument("--surfaces", nargs="+", default=["openai", "triton", "offline"],
                    choices=["openai", "triton", "offline"])
    ap.add_argument("--conditions", nargs="+", default=list(BUSY), choices=list(BUSY))
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt_len", type=int, default=370)
    ap.add_argument("--new_tokens", type=int, default=40)
    ap.add_argument("--threads", type=int, default=None, help="the engine's threads (default: its own choice)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.engine_dir)
    tokens = source_tokens(tokenizer)
    print(cpu())
    log_dir = (args.json.parent if args.json else Path("bench_out")) / "burst_logs"
    results = {}
    for surface in args.surfaces:
        print(f"{surface}:", file=sys.stderr, flush=True)
        results[surface] = run_offline(args, tokenizer, tokens) if surface == "offline" else \
            run_http(surface, args, tokenizer, tokens, log_dir)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    print(f"load average at the end: {os.getloadavg()}")
    report(results)


if __name__ == "__main__":
    main()
