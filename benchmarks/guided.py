"""Guided decoding (structured outputs), in one run:

1. decode throughput at batch 16 with every row JSON-schema guided against the same batch unguided,
   on the SmolLM-135M shape (random weights, with a byte-level BPE tokenizer of its 49,152 tokens
   trained on the standard library's source, so that the grammar sees a real code vocabulary).
   The guided rows' schema keeps them generating for all --output_len tokens (an array of at least
   --min_items short strings), so both batches stay full;
2. the first compilation of a 30-field schema and a second request for it (xgrammar's cache), as the
   engine core compiles it, and the time to first token of a guided request against an unguided one;
3. on the default model (tests/json_schemas.py's suite, temperature 1.0): how many outputs finish
   and validate with `disable_any_whitespace` on (the default) and off.

  python benchmarks/guided.py --threads 2
"""
import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).parent))


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def smollm_with_bpe(out: Path) -> Path:
    """SmolLM-135M's shape, random weights, a 49,152-token byte-level BPE tokenizer."""
    if (out / "config.json").exists():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM

    throughput = load(Path(__file__).parent / "throughput.py", "throughput")
    train = load(ROOT / "examples" / "train_default_model.py", "train_default_model")
    _, files = train.stdlib_files()
    texts = [f.read_text(errors="replace") for f in files]
    tokenizer = train.train_tokenizer(texts, throughput.SMOLLM_135M["vocab_size"])
    eot = tokenizer.convert_tokens_to_ids(train.EOT)
    config = LlamaConfig(**{**throughput.SMOLLM_135M, "bos_token_id": eot, "eos_token_id": eot},
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def thirty_fields() -> dict:
    kinds = [{"type": "string", "maxLength": 16}, {"type": "integer", "minimum": 0}, {"type": "boolean"},
             {"enum": ["low", "medium", "high"]}, {"type": "number"}, {"type": "string", "format": "date"}]
    props = {f"field_{i:02d}": kinds[i % len(kinds)] for i in range(30)}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def decode_rate(llm, prompts, params) -> float:
    outs = llm.generate(prompts, params)
    start = min(o.metrics.first_token_time for o in outs)
    end = max(o.metrics.finished_time for o in outs)
    return sum(len(o.outputs[0].token_ids) - 1 for o in outs) / (end - start), outs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/guided"))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--min_items", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from kiln import LLM, SamplingParams
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.runtime.sampling_params import GuidedDecodingParams as Guide
    from kiln.utils import cpu_summary

    print(cpu_summary())
    print(f"load average at the start: {os.getloadavg()[0]:.1f}")
    work = args.work_dir
    hf = smollm_with_bpe(work / "hf")
    engine_dir = work / "engine"
    if not (engine_dir / "config.json").exists():
        convert_checkpoint(hf, work / "ckpt", dtype="bfloat16")
        build_engine(work / "ckpt", engine_dir, BuildConfig(max_batch_size=args.batch, max_input_len=64,
                                                            max_seq_len=64 + args.output_len + 8, max_num_tokens=1024))
    llm = LLM(engine_dir)
    vocab = llm.llm_engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)

    def prompts():
        return [{"prompt_token_ids": torch.randint(3, vocab, (32,), generator=g).tolist()} for _ in range(args.batch)]

    # 1. batch decode, guided against unguided
    items = {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": args.min_items}
    long_list = {"type": "object", "properties": {"items": items}, "required": ["items"]}
    guide = Guide(json=long_list)
    plain = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True, seed=0)
    guided = SamplingParams(temperature=1.0, max_tokens=args.output_len, seed=0, guided_decoding=guide)
    llm.generate(prompts()[:1], SamplingParams(max_tokens=4, guided_decoding=guide))  # compile, warm up
    rates = {"unguided": [], "guided": []}
    for _ in range(args.repeats):
        for name, params in (("unguided", plain), ("guided", guided)):
            rate, outs = decode_rate(llm, prompts(), params)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outs), "a row finished early"
            rates[name].append(rate)
    best = {k: max(v) for k, v in rates.items()}

    # 2. compile time (the core's manager, as a request meets it) and time to first token
    manager = llm.llm_engine.core.structured
    schema = thirty_fields()
    start = time.perf_counter()
    manager.compile(Guide(json=schema))
    cold = time.perf_counter() - start
    start = time.perf_counter()
    manager.compile(Guide(json=schema))
    warm = time.perf_counter() - start
    one = prompts()[:1]
    ttft = {}
    for name, params in (("unguided", SamplingParams(max_tokens=1)),
                         ("guided, compiled before", SamplingParams(max_tokens=1, guided_decoding=Guide(json=schema)))):
        out = llm.generate(one, params)[0]
        ttft[name] = out.metrics.first_token_time - out.metrics.arrival_time
    llm.llm_engine.shutdown()

    # 3. whitespace, on the default model
    import jsonschema
    from json_schemas import SCHEMAS

    default_dir = work / "default_engine"
    if not (default_dir / "config.json").exists():
        convert_checkpoint(ROOT / "models" / "kiln-tiny-stdlib", work / "default_ckpt", dtype="bfloat16")
        build_engine(work / "default_ckpt", default_dir, BuildConfig(max_batch_size=16, max_input_len=128,
                                                                     max_seq_len=512, max_num_tokens=512))
    small = LLM(default_dir)
    suite = {}
    for disable in (True, False):
        names = list(SCHEMAS)
        outs = small.generate(["config = "] * len(names), [
            SamplingParams(temperature=1.0, max_tokens=400, seed=i,
                           guided_decoding=Guide(json=SCHEMAS[n], disable_any_whitespace=disable))
            for i, n in enumerate(names)])
        finished = [(n, o.outputs[0]) for n, o in zip(names, outs) if o.outputs[0].finish_reason == "stop"]
        ok = 0
        for n, c in finished:
            try:
                jsonschema.validate(json.loads(c.text), SCHEMAS[n],
                                    format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        suite[disable] = (len(finished), ok, sum(len(o.outputs[0].token_ids) for o in outs) / len(names))

    print(f"\nbatch {args.batch} decode, {args.output_len} tokens a row, {torch.get_num_threads()} threads "
          f"(best of {args.repeats}): unguided {best['unguided']:.1f} tok/s, JSON-schema guided {best['guided']:.1f} "
          f"tok/s = {best['guided'] / best['unguided']:.2f}x (all rounds: {rates})")
    print(f"30-field schema: first compile {cold * 1e3:.1f} ms, again (cache) {warm * 1e3:.3f} ms")
    print("time to first token, one 32-token prompt: " + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ttft.items()))
    for disable, (fin, ok, mean) in suite.items():
        print(f"default model, {len(SCHEMAS)} schemas, temperature 1.0, max_tokens 400, disable_any_whitespace="
              f"{disable}: {fin} finished, {ok} of them valid, {mean:.0f} tokens per output on average")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
