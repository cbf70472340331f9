"""Speed on a shared machine: Kiln, HF transformers and llama.cpp quiet and next to other CPU users.

Each runtime runs three workloads on the SmolLM-135M shape (random weights, benchmarks/throughput.py's
model): decode at batch 1 and at batch 16 (64-token prompts, --new_tokens each) and prefill of a
512-token prompt (--prefills fresh prompts, one step each), under each condition:
  quiet     nothing else running;
  busy1     next to one process spinning in a pure Python loop;
  busy2     next to two;
  kiln      next to another Kiln engine decoding batch 16 without pause (its default threads);
  quota1.5  in a CPU cgroup limited to 1.5 CPUs (v2 cpu.max or v1 cpu.cfs_quota_us; needs root and a
            writable cgroup tree: the condition is skipped, saying why, where it cannot be made).
Every measurement runs in a fresh process (the quota one inside the cgroup from its first instruction,
so a runtime's own thread count choice sees it). Reported per workload: tokens/s, its ratio to the same
runtime's quiet figure, and the p50 / p99 of the step times (a decode step: one token of each
sequence; a prefill step: the whole prompt). Prompts are random token ids, new per prefill, so the
prefix cache serves none of them.

--baseline DIR adds a second Kiln ("kiln@base"): the kiln package of another checkout (a git worktree
of an older commit) on the same engine, measured alternately with this one in every condition;
--baseline_engine_dir runs kiln@base on another engine (built by that checkout, or with other
options), with this checkout's package unless --baseline is given too.

  python benchmarks/contention.py
  python benchmarks/contention.py --runtimes kiln hf llama_cpp --conditions quiet busy1 quota1.5 --json out.json
  git worktree add /tmp/base HEAD~3 && python benchmarks/contention.py --baseline /tmp/base --runtimes kiln
  python benchmarks/contention.py --baseline_engine_dir ENGINE_BUILT_OTHERWISE --runtimes kiln
"""
import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONDITIONS = ("quiet", "busy1", "busy2", "kiln", "quota1.5")
WORKLOADS = ("decode_b1", "decode_b16", "prefill_512")
CGROUP = "kiln-contention"


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(batch)]


def summary(tokens: int, steps: list[float]) -> dict:
    s = sorted(steps)
    return {"tok_s": tokens / sum(s), "p50_ms": s[len(s) // 2] * 1e3,
            "p99_ms": s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))] * 1e3, "steps": len(s)}


# --- workers: one runtime in this process, its figures as JSON on stdout ---

def run_kiln(args) -> dict:
    from kiln import SamplingParams
    from kiln.runtime.frontend.llm_engine import LLMEngine

    engine = LLMEngine(args.engine_dir)
    vocab = engine.model_config.vocab_size

    def steps_of(batch, length, new, seed):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        for p in prompts(batch, length, vocab, seed):
            engine.add_request({"prompt_token_ids": p}, params)
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return times

    steps_of(2, 16, 4, seed=99)  # warm-up
    out = {}
    for batch in (1, 16):
        times = steps_of(batch, 64, args.new_tokens, seed=batch)[1:]  # the first step is the prefill
        out[f"decode_b{batch}"] = summary(batch * len(times), times)
    pre = [steps_of(1, 512, 1, seed=1000 + i)[0] for i in range(args.prefills)]
    out["prefill_512"] = summary(512 * len(pre), pre)
    out["threads"] = engine.threads
    engine.shutdown()
    return out


def run_hf(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf_dir, dtype=torch.bfloat16).eval()
    vocab = model.config.vocab_size

    @torch.inference_mode()
    def decode_steps(batch, new, seed):
        ids = torch.tensor(prompts(batch, 64, vocab, seed))
        out = model(ids, use_cache=True)
        past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(new - 1):
            start = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
        return times

    @torch.inference_mode()
    def prefill(seed):
        ids = torch.tensor(prompts(1, 512, vocab, seed))
        start = time.perf_counter()
        model(ids, use_cache=False).logits[:, -1].argmax(-1)
        return time.perf_counter() - start

    decode_steps(2, 4, seed=99)
    out = {}
    for batch in (1, 16):
        times = decode_steps(batch, args.new_tokens, seed=batch)
        out[f"decode_b{batch}"] = summary(batch * len(times), times)
    pre = [prefill(1000 + i) for i in range(args.prefills)]
    out["prefill_512"] = summary(512 * len(pre), pre)
    out["threads"] = torch.get_num_threads()
    return out


def run_llama_cpp(args) -> dict:
    sys.path.insert(0, str(HERE))
    import llama_cpp_bench as lcb

    threads = args.threads or len(os.sched_getaffinity(0))
    gguf = lcb.gguf_files(Path(args.hf_dir), args.work / "llama_cpp", ("bf16",))["bf16"]
    model = lcb.LlamaCpp(gguf, threads, 16, 64 + args.new_tokens + 8)
    vocab = model.vocab
    model.decode(prompts(2, 16, vocab, 99), 4)
    out = {}
    for batch in (1, 16):
        model.decode(prompts(batch, 64, vocab, batch), args.new_tokens - 1)
        out[f"decode_b{batch}"] = summary(batch * len(model.step_times), model.step_times)
    model.close()
    model = lcb.LlamaCpp(gguf, threads, 1, 520)
    pre = [model.prefill(p) for p in prompts(args.prefills, 512, vocab, 1000)]
    out["prefill_512"] = summary(512 * len(pre), pre)
    out["threads"] = threads
    model.close()
    return out


def run_competitor(args) -> None:
    """Another Kiln engine decoding batch 16 until killed (the `kiln` condition's load)."""
    from kiln import SamplingParams
    from kiln.runtime.frontend.llm_engine import LLMEngine

    engine = LLMEngine(args.engine_dir)
    params = SamplingParams(temperature=0, max_tokens=engine.build_config.max_seq_len - 64, ignore_eos=True)
    print("ready", flush=True)
    while True:
        if not engine.has_unfinished_requests():
            for p in prompts(16, 64, engine.model_config.vocab_size, 7):
                engine.add_request({"prompt_token_ids": p}, params)
        engine.step()


WORKERS = {"kiln": run_kiln, "kiln@base": run_kiln, "hf": run_hf, "llama_cpp": run_llama_cpp}


# --- the driver ---

def cgroup_for_quota(cpus: float) -> tuple[Path | None, str]:
    """A CPU cgroup limited to `cpus` CPUs: (its cgroup.procs file, "") or (None, why not)."""
    period = 100_000
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").is_file():
            if "cpu" not in (v2 / "cgroup.subtree_control").read_text().split():
                (v2 / "cgroup.subtree_control").write_text("+cpu")
            group = v2 / CGROUP
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
        elif (v2 / "cpu" / "cpu.cfs_quota_us").is_file():
            group = v2 / "cpu" / CGROUP
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text(str(period))
            (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
        else:
            return None, "no cgroup v2 cpu.max or v1 cpu controller under /sys/fs/cgroup"
    except OSError as e:
        return None, f"cannot make a CPU cgroup ({e})"
    return group / "cgroup.procs", ""


def start_load(condition: str, args) -> list[subprocess.Popen]:
    if condition.startswith("busy"):
        return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(int(condition[4:]))]
    if condition == "kiln":
        p = subprocess.Popen([sys.executable, __file__, "--worker", "competitor", "--engine_dir", str(args.engine_dir)],
                             stdout=subprocess.PIPE, text=True, env=worker_env("kiln", args))
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError("the competing Kiln engine did not start")
        return [p]
    return []


def worker_env(runtime: str, args) -> dict:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    if runtime == "kiln@base":
        env["PYTHONPATH"] = str(args.baseline or HERE.parent)
    else:
        env["PYTHONPATH"] = str(HERE.parent)
    return env


def measure(runtime: str, condition: str, args, procs: Path | None) -> dict:
    engine_dir = args.baseline_engine_dir if runtime == "kiln@base" and args.baseline_engine_dir else args.engine_dir
    cmd = [sys.executable, __file__, "--worker", runtime, "--engine_dir", str(engine_dir), "--hf_dir",
           str(args.hf_dir), "--work", str(args.work), "--new_tokens", str(args.new_tokens),
           "--prefills", str(args.prefills)] + (["--threads", str(args.threads)] if args.threads else [])
    join = (lambda: procs.write_text(str(os.getpid()))) if procs else None
    r = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(runtime, args), preexec_fn=join,
                       cwd=args.baseline if runtime == "kiln@base" and args.baseline else HERE.parent)
    if r.returncode != 0:
        raise RuntimeError(f"{runtime} under {condition} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def prepare(args) -> None:
    """The model, its bf16 aoti engine (max_batch_size 16) and, for llama.cpp, its GGUF."""
    sys.path.insert(0, str(HERE))
    import torch
    from throughput import make_model

    args.work.mkdir(parents=True, exist_ok=True)
    args.hf_dir = args.hf_dir or make_model(args.work / "hf", torch.bfloat16)
    if not (args.engine_dir / "config.json").exists():
        from kiln.build.builder import build_engine
        from kiln.config import BuildConfig
        from kiln.convert.cli import convert_checkpoint

        ckpt = args.work / "ckpt_bf16"
        if not (ckpt / "config.json").exists():
            convert_checkpoint(args.hf_dir, ckpt, dtype="bfloat16")
        build_engine(ckpt, args.engine_dir, BuildConfig(max_batch_size=16, max_input_len=512, max_seq_len=1024,
                                                        max_num_tokens=1024, tokens_per_block=32, backend="aoti"),
                     log=lambda m: print(m, file=sys.stderr))
    if "llama_cpp" in args.runtimes:
        import llama_cpp_bench as lcb

        lcb.gguf_files(Path(args.hf_dir), args.work / "llama_cpp", ("bf16",))


def report(results: dict, runtimes: list, conditions: list) -> None:
    head = f"{'runtime':<10} {'workload':<12}" + "".join(f" {c:>26}" for c in conditions)
    print(head)
    print(" " * 24 + "".join(f" {'tok/s (x quiet) p50/p99 ms':>26}" for _ in conditions))
    for rt in runtimes:
        for w in WORKLOADS:
            quiet = results.get(("quiet", rt), {}).get(w, {}).get("tok_s")
            cells = []
            for c in conditions:
                r = results.get((c, rt))
                if r is None:
                    cells.append(f"{'-':>26}")
                    continue
                m = r[w]
                ratio = f"{m['tok_s'] / quiet:.2f}x" if quiet else "-"
                cells.append(f" {m['tok_s']:>7.0f} ({ratio:>5}) {m['p50_ms']:>5.1f}/{m['p99_ms']:<6.1f}")
            print(f"{rt:<10} {w:<12}" + "".join(cells))
    threads = {f"{rt}@{c}": r.get("threads") for (c, rt), r in results.items()}
    print("threads: " + ", ".join(f"{k}={v}" for k, v in threads.items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runtimes", nargs="+", default=["kiln", "hf", "llama_cpp"], choices=list(WORKERS))
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--baseline", type=Path, help="a checkout whose kiln package is measured as kiln@base")
    ap.add_argument("--baseline_engine_dir", type=Path, help="the engine kiln@base runs (default: --engine_dir)")
    ap.add_argument("--work", type=Path, default=HERE.parent / "bench_out" / "contention")
    ap.add_argument("--engine_dir", type=Path, default=None)
    ap.add_argument("--hf_dir", type=Path, default=None)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--prefills", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1, help="measure every condition this many times (the best kept)")
    ap.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: the CPUs it may use)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.engine_dir = args.engine_dir or args.work / "engine_aoti_bf16"
    if args.worker:
        if args.worker == "competitor":
            return run_competitor(args)
        print(json.dumps(WORKERS[args.worker](args)))
        return

    from kiln.utils import cpu_summary

    args.engine_dir = args.engine_dir.resolve()  # the baseline's workers run in its checkout
    args.baseline_engine_dir = args.baseline_engine_dir and args.baseline_engine_dir.resolve()
    if args.baseline or args.baseline_engine_dir:
        args.baseline = args.baseline and args.baseline.resolve()
        if "kiln" in args.runtimes and "kiln@base" not in args.runtimes:
            args.runtimes.insert(args.runtimes.index("kiln") + 1, "kiln@base")
    print(cpu_summary())
    print(f"uptime at the start: {os.getloadavg()}")
    prepare(args)
    results = {}
    for condition in args.conditions:
        procs = None
        if condition.startswith("quota"):
            procs, why = cgroup_for_quota(float(condition[5:]))
            if procs is None:
                print(f"{condition}: skipped: {why}")
                continue
        for round_ in range(args.rounds):
            order = args.runtimes if round_ % 2 == 0 else args.runtimes[::-1]
            for rt in order:
                load = start_load(condition, args)
                try:
                    time.sleep(0.5 if load else 0)
                    r = measure(rt, condition, args, procs)
                finally:
                    for p in load:
                        p.kill()
                        p.wait()
                best = results.get((condition, rt))
                if best is not None:  # the best of the rounds, per workload
                    r = {w: max(best[w], r[w], key=lambda m: m["tok_s"]) if w in WORKLOADS else r[w] for w in r}
                results[(condition, rt)] = r
                print(f"{condition} {rt}: " + ", ".join(f"{w} {r[w]['tok_s']:.0f} tok/s" for w in WORKLOADS),
                      file=sys.stderr, flush=True)
                if args.json:  # as it goes: a failure later keeps what was measured
                    args.json.write_text(json.dumps({f"{c}|{rt}": r for (c, rt), r in results.items()}, indent=1))
    print(f"uptime at the end: {os.getloadavg()}")
    report(results, args.runtimes, [c for c in args.conditions if any((c, rt) in results for rt in args.runtimes)])


if __name__ == "__main__":
    main()
