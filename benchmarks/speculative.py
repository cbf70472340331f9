"""Speculative decoding against plain decoding, in one run: decode tokens/s of the same greedy
requests with no speculation, with EAGLE-3 (the default model's trained head,
models/kiln-tiny-stdlib-eagle3, converted beside it into an engine of its own), with ngram prompt
lookup and with a draft engine, each with a fixed k and with num_speculative_tokens "auto", at several
batch sizes, the methods alternating within each round; with each method's acceptance rate and mean
accepted length (vLLM's: tokens a verification step emits, 1 + accepted drafts per step).

On this 6M-parameter model a plain decode step is under a millisecond, mostly fixed cost, and a
step verifying 1 + k tokens costs more than one, while an EAGLE-3 draft pass (eager, in Python) costs
about half a plain step: speculation with a fixed k loses at every batch size even at 2.66 tokens
per step, and "auto" mostly declines to draft. "same tokens as none" below 64/64 is bfloat16: the
context phase's 1 + k tokens round differently from decode (float32 outputs are equal; tests).

Workloads, from functions of the standard library files the default model was *not* trained on
(its README's held-out files), so that what it copies comes from the prompt, not from memory:
  repetitive  a function shown whole, then its first third again: the model is asked to continue
              code it has just been shown (code editing, RAG: output copied from the input).
  fresh       the first third of another function, not shown before: new code.
The default model (6M parameters, 40 minutes of training) does not copy from its context: its
greedy continuation of a repeated function is not the function (in a probe of 24 functions,
shown once or three times, none went on with the function's next 20 characters), so with it the
two workloads differ less than they would with a larger model (--model_dir); ngram's hits come
mostly from the loops the model falls into ("of the line of the line").

The draft engine is made here from the target model without training: the same checkpoint cut to
its first --draft_layers decoder layers (the other layers' weights dropped, config
num_hidden_layers set to match; the same embeddings, final norm, tied lm_head and tokenizer),
converted and built as an engine of its own. Such a truncated model agrees with the full one only
where the next token is easy; it is the cheapest draft that needs no data.

Engines (bf16, aoti, as `make demo`) are converted and built into --work_dir once and reused.
Requests run --batch at a time (1: latency, where speculation is meant to help; at 16 the
verification of 1 + k tokens per sequence costs more compute than the steps it saves). Where
speculation loses shows in the table: every rejected draft token is a token verified for nothing,
and a draft engine also pays its own k steps per verification; on a model this small much of a
step is fixed cost (scheduling, inputs, the call), so a 2-layer draft step saves less than its
layers suggest.

  python benchmarks/speculative.py                 # 64 fresh prompts x 128 new tokens, k = 3, batch 1 4 16 64
  python benchmarks/speculative.py --num_prompts 2 --max_tokens 16 --batch 1 --threads 1   # a smoke run
"""
import argparse
import ast
import json
import os
import re
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
# Held out from the default model's training set (models/kiln-tiny-stdlib/README.md).
HELD_OUT = ("getopt.py", "operator.py", "xdrlib.py", "email/message.py", "ssl.py", "unittest/runner.py",
            "xmlrpc/server.py", "tkinter/filedialog.py", "importlib/resources/readers.py", "curses/textpad.py")


# ---------------------------------------------------------------------------------- workloads
def functions(tokenizer, lo: int, hi: int) -> list[str]:
    """Source of the held-out files' functions (methods dedented) of lo..hi tokens, in file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in HELD_OUT:
        path = stdlib / name
        if not path.is_file():
            continue
        text = path.read_text(encoding="utf-8")
        nodes = [n for n in ast.walk(ast.parse(text)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: n.lineno):
            src = textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")
            if src and lo <= len(tokenizer.encode(src)) <= hi:
                out.append(src)
    return out


def workloads(tokenizer, n: int, names) -> dict[str, list[str]]:
    fns = functions(tokenizer, 60, 160)  # shown whole, then a third again: in the model's 256-token training window
    repetitive = fns[0::2][:n]
    fresh = [src for src in functions(tokenizer, 40, 600) if src not in repetitive][:n]  # only their first third
    for name, got in (("repetitive", repetitive), ("fresh", fresh)):
        if name in names and len(got) < n:
            sys.exit(f"only {len(got)} functions for the {name} workload in the held-out stdlib files; ask for fewer "
                     f"prompts")

    def head(src: str) -> str:
        """Its first third, cut after a word inside a line: a prompt ending at a line's end is as
        likely to be followed by a new function as by the rest of this one."""
        cut = src[:len(src) // 3].rstrip()
        return cut[:cut.rfind(" ")] if " " in cut.splitlines()[-1].strip() else cut

    work = {"repetitive": [f"{src}\n\n{head(src)}" for src in repetitive], "fresh": [head(src) for src in fresh]}
    return {name: work[name] for name in names}


# ---------------------------------------------------------------------------------- engines
def draft_model(model_dir: Path, out: Path, layers: int) -> Path:
    """The HF model cut to its first `layers` decoder layers (see the docstring)."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").exists():
        return out
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= layers < config["num_hidden_layers"]:
        sys.exit(f"--draft_layers must be in [1, {config['num_hidden_layers'] - 1}] (the model has "
                 f"{config['num_hidden_layers']} layers), got {layers}")
    weights = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(f))
    layer = re.compile(r"model\.layers\.(\d+)\.")
    kept = {k: v for k, v in weights.items() if not (m := layer.match(k)) or int(m.group(1)) < layers}
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    for f in model_dir.iterdir():  # tokenizer, generation and chat template files
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, tmp / f.name)
    (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    save_file(kept, tmp / "model.safetensors", metadata={"format": "pt"})
    tmp.rename(out)
    return out


def engine(hf_dir: Path, work: Path, name: str, max_batch: int, rebuild: bool, eagle: Path | None = None) -> Path:
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint

    out = work / f"engine_{name}_b{max_batch}"
    if (out / "config.json").exists() and not rebuild:
        return out
    shutil.rmtree(out, ignore_errors=True)
    ckpt = work / f"ckpt_{name}"
    if not (ckpt / "config.json").exists():
        convert_checkpoint(hf_dir, ckpt, dtype="bfloat16", eagle_model_dir=eagle)
    # Both engines alike: the draft must hold as long a sequence as the target.
    build = BuildConfig(max_batch_size=max_batch, max_input_len=512, max_seq_len=1024, max_num_tokens=4096,
                        tokens_per_block=32, backend="aoti")  # a batch of 16 prompts prefills in one step
    start = time.perf_counter()
    build_engine(ckpt, out, build, log=lambda m: None)
    print(f"built {out} in {time.perf_counter() - start:.0f}s", file=sys.stderr)
    return out


# ---------------------------------------------------------------------------------- measuring
def merge(a: dict, b: dict) -> dict:
    """Two rounds of one method as one: tokens and seconds summed."""
    out = {key: a[key] + b[key] for key in ("decode_tokens", "seconds", "num_drafts", "num_draft_tokens",
                                            "num_accepted_tokens")}
    out["decode_tokens_per_s"] = out["decode_tokens"] / out["seconds"]
    out["outputs"] = a["outputs"]
    out["acceptance_rate"] = out["num_accepted_tokens"] / out["num_draft_tokens"] if out["num_draft_tokens"] else None
    out["mean_accepted_length"] = 1 + out["num_accepted_tokens"] / out["num_drafts"] if out["num_drafts"] else None
    return out


def measure(llm, prompts: list[str], params, batch: int) -> dict:
    """Decode tokens/s over the prompts, `batch` at a time: tokens after each request's first,
    over the time from a batch's first first token to its last finish (prefill left out)."""
    stats = llm.llm_engine.get_stats().get("spec") or {}
    tokens, seconds, outputs = 0, 0.0, []
    for i in range(0, len(prompts), batch):
        outs = llm.generate(prompts[i:i + batch], params)
        ms = [o.metrics for o in outs]
        tokens += sum(m.num_output_tokens - 1 for m in ms)
        seconds += max(m.finished_time for m in ms) - min(m.first_token_time for m in ms)
        outputs += [o.outputs[0].token_ids for o in outs]
    after = llm.llm_engine.get_stats().get("spec") or {}
    delta = {k: after.get(k, 0) - stats.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return {"decode_tokens_per_s": tokens / seconds, "decode_tokens": tokens, "seconds": seconds,
            "outputs": outputs, **delta,
            "acceptance_rate": delta["num_accepted_tokens"] / delta["num_draft_tokens"]
            if delta["num_draft_tokens"] else None,
            "mean_accepted_length": 1 + delta["num_accepted_tokens"] / delta["num_drafts"]
            if delta["num_drafts"] else None}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model_dir", type=Path, default=ROOT / "models" / "kiln-tiny-stdlib", help="the target (HF)")
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/speculative"),
                    help="checkpoints and engines, built once and reused")
    ap.add_argument("--draft_layers", type=int, default=2, help="decoder layers the draft keeps")
    ap.add_argument("--num_prompts", type=int, default=64, help="prompts per workload")
    ap.add_argument("--max_tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--num_speculative_tokens", "-k", type=int, default=3, help="k of the fixed-k methods")
    ap.add_argument("--eagle_model_dir", type=Path, default=ROOT / "models" / "kiln-tiny-stdlib-eagle3",
                    help="the EAGLE-3 draft (converted beside the target into an engine of its own)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds, each running every method in turn")
    ap.add_argument("--workloads", nargs="+", default=["fresh"], choices=["fresh", "repetitive"])
    ap.add_argument("--prompt_lookup_max", type=int, default=4)
    ap.add_argument("--prompt_lookup_min", type=int, default=1)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64], help="requests at a time (one run each)")
    ap.add_argument("--methods", nargs="+", default=["none", "eagle3", "eagle3-auto", "ngram", "ngram-auto"],
                    choices=["none", "ngram", "ngram-auto", "draft_model", "eagle3", "eagle3-auto"],
                    help="-auto: num_speculative_tokens \"auto\" (k per request and step, 0 included)")
    # On a machine busy with other work, 1: two OpenMP threads waiting at each other's barriers on
    # oversubscribed cores made this model's steps 100x slower here.
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    ap.add_argument("--rebuild", action="store_true", help="build the engines again")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kiln import LLM, SamplingParams
    from kiln.utils import cpu_summary

    print(cpu_summary())
    print(f"load average at the start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    max_batch = max(args.batch)
    target = engine(args.model_dir, args.work_dir, "target", max_batch, args.rebuild)
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min}
    configs = {"none": None, "ngram": {**ngram, "num_speculative_tokens": k},
               "ngram-auto": {**ngram, "num_speculative_tokens": "auto"},
               "eagle3": {"method": "eagle3", "num_speculative_tokens": k},
               "eagle3-auto": {"method": "eagle3", "num_speculative_tokens": "auto"}}
    engines = dict.fromkeys(configs, target)
    if any(m.startswith("eagle3") for m in args.methods):  # the same target, built to return the draft's layers
        engines["eagle3"] = engines["eagle3-auto"] = engine(args.model_dir, args.work_dir, "target_eagle3", max_batch,
                                                            args.rebuild, args.eagle_model_dir)
    if "draft_model" in args.methods:
        hf_draft = draft_model(args.model_dir, args.work_dir / f"hf_draft{args.draft_layers}", args.draft_layers)
        configs["draft_model"] = {"method": "draft_model", "num_speculative_tokens": k, "draft_engine_dir": str(
            engine(hf_draft, args.work_dir, f"draft{args.draft_layers}", max_batch, args.rebuild))}
        engines["draft_model"] = target

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)  # the same work for all
    llms = {m: LLM(engines[m], speculative_config=configs[m], threads=args.threads, enable_prefix_caching=False)
            for m in args.methods}
    work = workloads(next(iter(llms.values())).get_tokenizer(), args.num_prompts, args.workloads)
    for llm in llms.values():
        llm.generate(work[args.workloads[0]][0], SamplingParams(temperature=0, max_tokens=8))  # warm-up
    results = {}
    for round_ in range(args.rounds):  # methods alternate, so that a slower stretch of the machine hits all
        for name, prompts in work.items():
            for b in args.batch:
                for method, llm in llms.items():
                    r = measure(llm, prompts, params, b)
                    prev = results.get((method, name, b))
                    results[(method, name, b)] = r if prev is None else merge(prev, r)
                    print(f"round {round_}, {method}, {name}, batch {b}: {r['decode_tokens_per_s']:.1f} decode tok/s",
                          file=sys.stderr)
    for llm in llms.values():
        llm.llm_engine.shutdown()
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")

    print(f"\nk = {k} (-auto: chosen per request and step); ngram lookup {args.prompt_lookup_min}-"
          f"{args.prompt_lookup_max} tokens; EAGLE-3 draft {args.eagle_model_dir}; draft_model: the first "
          f"{args.draft_layers} of the target's layers; {args.num_prompts} prompts x {args.max_tokens} new tokens, "
          f"greedy, {args.rounds} rounds\n")
    cols = ["workload", "batch", "method", "decode tok/s", "vs none", "acceptance", "mean accepted length",
            "same tokens as none"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for name in work:
        for b in args.batch:
            base = results.get(("none", name, b))
            for method in args.methods:
                r = results[(method, name, b)]
                speedup = f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if base else "-"
                same = f"{sum(x == y for x, y in zip(r['outputs'], base['outputs']))}/{len(r['outputs'])}" \
                    if base else "-"
                acc, mal = r["acceptance_rate"], r["mean_accepted_length"]
                print(f"| {name} | {b} | {method} | {r['decode_tokens_per_s']:.1f} | {speedup} | "
                      f"{'-' if acc is None else f'{100 * acc:.0f}%'} | {'-' if mal is None else f'{mal:.2f}'} | "
                      f"{same} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"cpu": cpu_summary(), "args": {a: str(v) for a, v in vars(args).items()},
                                         "runs": [{"method": m, "workload": w, "batch": b,
                                                   **{x: y for x, y in r.items() if x != "outputs"}}
                                                  for (m, w, b), r in results.items()]}, indent=2))


if __name__ == "__main__":
    main()
