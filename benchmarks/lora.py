"""Many LoRA adapters on one engine, in one run, on the SmolLM-135M shape (random bf16 weights):

1. decode tokens/s at batch --batch (prompts of --input_len fresh random tokens, --output_len new
   tokens each) of the base engine (built without adapters), of the LoRA engine serving base-model
   requests only, and of the LoRA engine with the batch split evenly over --adapters different adapters
   (PEFT, rank --rank on all seven linear modules), alternating round by round;
2. what loading an adapter costs: reading and checking the PEFT dir, and the first request of an
   adapter no slot holds against one whose adapter is loaded (time to first token).

Decode is timed from the first first token to the last finish, over the tokens after the first.
It prints the CPU and its ISA flags, the load average before and after, and the share of timed
prompt tokens the prefix cache served (0% expected: every timed prompt is new).

  python benchmarks/lora.py --threads 2
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import throughput  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]


def save_adapters(base: Path, root: Path, count: int, rank: int) -> list[Path]:
    """`count` PEFT adapters of the base model, random A and B (PEFT starts B at zero)."""
    import peft
    import transformers

    paths = [root / f"adapter{i}_r{rank}" for i in range(count)]
    if all((p / "adapter_config.json").exists() for p in paths):
        return paths
    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL))
    for i, path in enumerate(paths):
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
        model.save_pretrained(path)
    return paths


def first_token_seconds(llm, lora, vocab: int) -> float:
    from kiln import SamplingParams

    start = time.perf_counter()
    llm.generate(throughput.fresh(1, 16, vocab), SamplingParams(temperature=0, max_tokens=1), lora_request=lora)
    return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work_dir", type=Path, default=Path("bench_out/lora"))
    ap.add_argument("--backend", default="aoti", choices=["aoti", "eager"])
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input_len", type=int, default=64)
    ap.add_argument("--output_len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="rounds; each cell keeps its fastest")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    from kiln import LLM, LoRARequest
    from kiln.build.builder import build_engine
    from kiln.config import BuildConfig, PretrainedConfig
    from kiln.convert.cli import convert_checkpoint
    from kiln.lora.adapter import read_adapter

    print(throughput.cpu_summary())
    print(f"load average at the start: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    if args.threads:
        torch.set_num_threads(args.threads)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    hf = throughput.make_model(work / "hf", torch.bfloat16)
    paths = save_adapters(hf, work / "adapters", args.adapters, args.rank)
    ckpt = work / "ckpt_bf16"
    if not (ckpt / "config.json").exists():
        convert_checkpoint(hf, ckpt, dtype="bfloat16")
    engines = {}
    for name, lora in (("base", None), ("lora", {"max_lora_rank": args.rank, "lora_target_modules": MODULES})):
        engines[name] = work / f"engine_{args.backend}_{name}_r{args.rank}"
        if not (engines[name] / "config.json").exists():
            build_engine(ckpt, engines[name], BuildConfig(
                max_batch_size=args.batch, max_input_len=args.input_len, max_seq_len=args.input_len + args.output_len,
                max_num_tokens=args.batch * args.input_len, tokens_per_block=32, backend=args.backend,
                lora_config=lora), log=lambda m: print(m, file=sys.stderr))

    config = PretrainedConfig.from_dict(json.loads((ckpt / "config.json").read_text()))
    start = time.perf_counter()
    for p in paths:
        read_adapter(p, config)
    read_seconds = (time.perf_counter() - start) / len(paths)

    base = LLM(engines["base"], skip_tokenizer_init=True)
    multi = LLM(engines["lora"], skip_tokenizer_init=True, max_loras=args.adapters)
    vocab = base.llm_engine.model_config.vocab_size
    requests = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    loras = [requests[i * len(requests) // args.batch] for i in range(args.batch)]
    # adapter load: a slot filled on the first request of each adapter, then the same adapter again
    cold = [first_token_seconds(multi, r, vocab) for r in requests]
    warm = [first_token_seconds(multi, r, vocab) for r in requests]
    plain = [first_token_seconds(multi, None, vocab) for _ in requests]
    for llm in (base, multi):  # warm-up
        throughput.decode_kiln(llm, args.batch, args.input_len, 8, vocab)
    throughput.decode_kiln(multi, args.batch, args.input_len, 8, vocab, loras)
    throughput.cache_share.update(prompt_tokens=0, cached_tokens=0)
    cells = {"base engine": [], "LoRA engine, base requests": [], f"LoRA engine, {args.adapters} adapters": []}
    for _ in range(args.repeats):
        for (name, runs), (llm, lora) in zip(cells.items(), ((base, None), (multi, None), (multi, loras))):
            runs.append(throughput.decode_kiln(llm, args.batch, args.input_len, args.output_len, vocab, lora))
    base.llm_engine.shutdown()
    multi.llm_engine.shutdown()

    ref = max(cells["base engine"])
    print(f"\ndecode, batch {args.batch}, {args.input_len} + {args.output_len} tokens, rank {args.rank} on "
          f"{len(MODULES)} modules, {torch.get_num_threads()} threads ({args.repeats} rounds, the fastest):")
    for name, runs in cells.items():
        print(f"  {name:34s} {max(runs):8.1f} tok/s  {max(runs) / ref:5.2f}x   (rounds: "
              f"{', '.join(f'{r:.1f}' for r in runs)})")
    share = throughput.cache_share
    print(f"prefix cache: {share['cached_tokens']} of {share['prompt_tokens']} timed prompt tokens")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    print(f"adapter load: reading and checking a PEFT dir {read_seconds * 1000:.1f} ms; first token of a "
          f"16-token prompt: new adapter {median(cold) * 1000:.1f} ms, loaded adapter {median(warm) * 1000:.1f} ms, "
          f"no adapter {median(plain) * 1000:.1f} ms (medians of {len(requests)})")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps({"cpu": throughput.cpu_summary(), "decode": cells, "read_s": read_seconds,
                                         "ttft_cold": cold, "ttft_warm": warm, "ttft_none": plain}, indent=1))


if __name__ == "__main__":
    main()
