"""Trains Kiln's default model: a small Llama (GQA, tied embeddings) on the Python standard library's
own source files, with a byte-level BPE tokenizer trained on the same files (or, with --experts, a
Mixtral of the same shape, whose quantized formats benchmarks/quant.py scores).

    python examples/train_default_model.py --minutes 40 --out models/kiln-tiny-stdlib
    python examples/train_default_model.py --minutes 15 --experts 8 --top_k 2 --intermediate 256 \
        --out bench_out/moe-stdlib

Every machine with Python has the data, and it may be redistributed (PSF License). Files are split
deterministically: after sorting the kept files by their path relative to the stdlib folder, every
file whose index % 25 == 0 is held out for evaluation. Training stops when its wall-clock budget
(`--minutes`) is spent; the learning rate follows a cosine over that budget (or over `--steps`), so a
run always ends at the minimum rate, then the model is evaluated, saved in bfloat16 and given a
model card with the run's real numbers.
"""
import argparse
import json
import math
import os
import platform
import shlex
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads collapse on a shared machine
import torch  # noqa: E402
import transformers  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

EOT = "<|endoftext|>"
HOLDOUT_EVERY = 25
# Test suites (repetitive assertions, some deliberately malformed or non-UTF-8 sources), codec tables
# and other generated files are left out.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "encodings", "pydoc_data", "site-packages", "__pycache__"}
EXCLUDED_PREFIXES = ("config-", "_sysconfigdata")
MAX_FILE_BYTES = 300_000
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        parts = path.relative_to(root).parts
        if EXCLUDED_DIRS & set(parts[:-1]) or parts[0].startswith(EXCLUDED_PREFIXES):
            continue
        if path.name.startswith("test_") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return root, files


def split(files: list[Path]) -> tuple[list[Path], list[Path]]:
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != 0]
    held_out = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == 0]
    return train, held_out


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    # Like Llama's tokenizers, encode() prepends BOS; documents are separated by it in training too.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, tok.token_to_id(EOT))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
                                   chat_template=CHAT_TEMPLATE, model_max_length=1024,
                                   model_input_names=["input_ids", "attention_mask"])


def token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """All texts as one stream, each document starting with BOS (= EOS, so it also ends the previous one)."""
    ids = tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]
    return torch.tensor([t for doc in ids for t in doc], dtype=torch.long)


def make_model(args, vocab_size: int, eot_id: int) -> LlamaForCausalLM:
    """A Llama, or with --experts a Mixtral (the same model with --experts SwiGLU experts of
    --intermediate width per layer, --top_k of them per token)."""
    common = dict(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
        initializer_range=0.02)
    torch.manual_seed(args.seed)
    if args.experts:
        config = transformers.MixtralConfig(**common, num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                                            sliding_window=None, architectures=["MixtralForCausalLM"])
        return transformers.MixtralForCausalLM(config)
    return LlamaForCausalLM(LlamaConfig(**common, architectures=["LlamaForCausalLM"]))


def autocast(dtype: str):
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16")


@torch.no_grad()
def held_out_nll(model, stream: torch.Tensor, seq_len: int, dtype: str, max_windows: int | None = None,
                 batch_size: int = 16) -> tuple[float, int]:
    """Sum of token NLLs and token count over non-overlapping windows of `seq_len` tokens."""
    model.eval()
    windows = [stream[s:s + seq_len + 1] for s in range(0, len(stream) - 1, seq_len)][:max_windows]
    total, count = 0.0, 0
    full = [w for w in windows if len(w) == seq_len + 1]
    batches = [torch.stack(full[i:i + batch_size]) for i in range(0, len(full), batch_size)]
    batches += [w[None] for w in windows if len(w) != seq_len + 1]
    for batch in batches:
        with autocast(dtype):
            logits = model(input_ids=batch[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(),
                                                   reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return total, count


def learning_rate(args, step: int, progress: float) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    moe = getattr(model.config, "num_local_experts", 0) > 0
    out = model(input_ids=batch[:, :-1], output_router_logits=moe) if moe else model(input_ids=batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1), batch[:, 1:].flatten())
    if moe and model.training:  # Mixtral's load-balancing loss keeps every expert in use
        loss = loss + model.config.router_aux_loss_coef * out.aux_loss
    return loss


def train(args, model, stream: torch.Tensor, held_out: torch.Tensor, log) -> dict:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    rng = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60
    n_windows = len(stream) - args.seq_len - 1
    model.train()
    start = time.perf_counter()
    step, tokens, smoothed, loads = 0, 0, None, []
    last_log = last_eval = start
    while True:
        elapsed = time.perf_counter() - start
        if args.steps is not None and step >= args.steps or args.steps is None and elapsed >= budget:
            break
        progress = step / args.steps if args.steps is not None else elapsed / budget
        lr = learning_rate(args, step, progress)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, n_windows, (args.batch_size,), generator=rng)
        batch = torch.stack([stream[o:o + args.seq_len + 1] for o in offsets.tolist()])
        with autocast(args.dtype):
            loss = lm_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens += batch[:, 1:].numel()
        value = loss.item()
        smoothed = value if smoothed is None else 0.95 * smoothed + 0.05 * value
        now = time.perf_counter()
        if now - last_log >= args.log_every_s or step == 1:
            loads.append(os.getloadavg()[0])
            log(f"step {step:6d}  loss {value:.4f}  avg {smoothed:.4f}  lr {lr:.2e}  "
                f"{tokens / (now - start):7.0f} tok/s  {(now - start) / 60:5.1f} min")
            last_log = now
        if args.eval_every_min and now - last_eval >= args.eval_every_min * 60:
            nll, count = held_out_nll(model, held_out, args.seq_len, args.dtype, max_windows=16)
            log(f"step {step:6d}  held-out loss (first 16 windows) {nll / count:.4f}")
            last_eval = time.perf_counter()
            start += last_eval - now  # evaluation does not count against the training budget
    wall = time.perf_counter() - start
    return {"steps": step, "tokens": tokens, "train_seconds": wall, "final_loss": smoothed,
            "tokens_per_s": tokens / wall, "mean_load_average": sum(loads) / len(loads)}


def write_card(out: Path, args, root: Path, train_files, held_out_files, n_params: int, config: LlamaConfig,
               stats: dict, train_tokens: int, held_out_tokens: int, held_out_bytes: int, ppl: float,
               nll_per_token: float, wall_s: float, samples: dict[str, str]) -> None:
    rel = [f.relative_to(root).as_posix() for f in held_out_files]
    size_mb = sum(p.stat().st_size for p in out.iterdir() if p.is_file()) / 1e6
    bits_per_byte = nll_per_token * held_out_tokens / held_out_bytes / math.log(2)
    sample_text = "".join(f"{name}:\n\n```python\n{text}\n```\n\n" for name, text in samples.items())
    threads, heads = torch.get_num_threads(), config.num_attention_heads
    minutes, epochs = stats["train_seconds"] / 60, stats["tokens"] / train_tokens
    precision = "bf16 autocast" if args.dtype == "bf16" else "fp32 weights and activations"
    cpu = f"{platform.machine()} ({_cpu_name()}, {os.cpu_count()} cores)"
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    text = f"""# kiln-tiny-stdlib

A {n_params / 1e6:.1f}M-parameter Llama trained for about {minutes:.0f} minutes on {threads} CPU threads on the
Python {platform.python_version()} standard library's own source code. It is Kiln's default model: it exists so
that `make demo`, examples and tests have real, redistributable weights that write plausible-looking
Python. **It is not a general-purpose model**: it knows only the style of the standard library, it has
no chat or instruction data (the chat template is there so that chat code paths can be exercised), and
its output is not correct code.

## Architecture

`{config.architectures[0]}` (Hugging Face transformers {transformers.__version__}), weights in bfloat16 safetensors.

| | |
|---|---|
| parameters | {n_params:,} (embeddings tied with the LM head) |
| hidden size / intermediate size | {config.hidden_size} / {config.intermediate_size} (SwiGLU) |
| layers | {config.num_hidden_layers} |
| attention heads / KV heads (GQA) | {heads} / {config.num_key_value_heads}, head dim {config.hidden_size // heads} |
| position embeddings | RoPE, theta {config.rope_theta:g}, `max_position_embeddings` {config.max_position_embeddings} \
(trained on {args.seq_len}-token windows) |
| vocabulary | {config.vocab_size} byte-level BPE tokens (`tokenizers`), trained on the training files |
| special tokens | `{EOT}` (id {config.bos_token_id}) is BOS, EOS and padding; `encode` prepends it |
| files on disk | {size_mb:.1f} MB |

Chat template (no chat training; for exercising chat code paths): `<|user|>\\n...<|endoftext|>\\n<|assistant|>\\n`.

## Data and license

The `.py` files of CPython {platform.python_version()}'s standard library (`sysconfig.get_paths()["stdlib"]`), which
are distributed under the Python Software Foundation License Version 2 (see `LICENSE.txt` in the
stdlib folder, <https://docs.python.org/3/license.html>). Left out: test suites (folders `test`,
`tests`, `idle_test` and files `test_*.py`), `encodings/` (generated codec tables), `pydoc_data/`,
`site-packages/`, `_sysconfigdata*`, `config-*`, files over {MAX_FILE_BYTES // 1000} kB and files that are not UTF-8.

Split: the {len(train_files) + len(held_out_files)} kept files, sorted by their path relative to the stdlib folder;
every file whose index % {HOLDOUT_EVERY} == 0 is held out ({len(held_out_files)} files, {held_out_tokens:,} tokens),
the other {len(train_files)} files ({train_tokens:,} tokens) are the training set, on which the tokenizer was trained too.

Held-out files: {", ".join(f"`{r}`" for r in rel)}.

## Training

```
{command}
```

AdamW (betas 0.9/0.95, weight decay {args.weight_decay}, grad clip 1.0), peak learning rate {args.lr:g} after
{args.warmup_steps} warm-up steps, cosine decay to {args.min_lr:g} over the wall-clock budget; batches of
{args.batch_size} random {args.seq_len}-token windows of the packed training stream (documents joined by
`{EOT}`), {precision}, seed {args.seed}, torch {torch.__version__}, {threads} threads on {cpu}.
The mean 1-minute load average during training was {stats['mean_load_average']:.1f}; above {threads} means the run
shared the cores with other work.

| | |
|---|---|
| training wall time | {minutes:.1f} min ({stats['steps']:,} steps, {stats['tokens']:,} tokens ≈ {epochs:.1f} epochs, \
{stats['tokens_per_s']:,.0f} tokens/s) |
| whole script wall time (tokenizer, training, evaluation, saving) | {wall_s / 60:.1f} min |
| final train loss (EMA over the last ~20 steps) | {stats['final_loss']:.3f} |
| held-out loss / perplexity | {nll_per_token:.3f} / **{ppl:.2f}** per token ({bits_per_byte:.3f} bits per byte) |

Held-out perplexity is exp of the mean token negative log-likelihood, computed with transformers on the
held-out files packed the same way as the training stream and cut into non-overlapping
{args.seq_len}-token windows (the training context), with the bfloat16 weights as saved, computed in
float32 (the dtype `from_pretrained` loads them in by default).

## Samples

Continuations of `def fibonacci(n):` (64 new tokens) with transformers' `generate`. Models this small
repeat themselves, most of all under greedy decoding; `make demo` samples with temperature 0.7, top-p
0.9 and repetition penalty 1.1.

{sample_text}"""
    (out / "README.md").write_text(text)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("models/kiln-tiny-stdlib"))
    p.add_argument("--minutes", type=float, default=40.0, help="wall-clock training budget")
    p.add_argument("--steps", type=int, default=None, help="train exactly this many steps instead")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2.75 x hidden, rounded to 32")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv_heads", type=int, default=2)
    p.add_argument("--max_positions", type=int, default=1024)
    p.add_argument("--seq_len", type=int, default=256)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min_lr", type=float, default=3e-4)
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--experts", type=int, default=0, help="a Mixtral with this many experts per layer (0: a Llama)")
    p.add_argument("--top_k", type=int, default=2, help="experts per token, with --experts")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32", help="bf16 = bfloat16 autocast")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log_every_s", type=float, default=30.0)
    p.add_argument("--eval_every_min", type=float, default=5.0)
    p.add_argument("--max_files", type=int, default=None, help="use only the first N files of each split (smoke tests)")
    p.add_argument("--bench", action="store_true", help="only time a few training steps and exit")
    args = p.parse_args()
    args.intermediate = args.intermediate or int(round(2.75 * args.hidden / 32) * 32)
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    root, files = stdlib_files()
    train_files, held_out_files = split(files)
    train_files, held_out_files = train_files[:args.max_files], held_out_files[:args.max_files]
    train_texts = [f.read_text(encoding="utf-8") for f in train_files]
    held_out_texts = [f.read_text(encoding="utf-8") for f in held_out_files]
    log(f"stdlib {root}: {len(train_files)} training files ({sum(map(len, train_texts)) / 1e6:.1f}M chars), "
        f"{len(held_out_files)} held out ({sum(map(len, held_out_texts)) / 1e6:.2f}M chars)")
    tokenizer = train_tokenizer(train_texts, args.vocab)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    stream = token_stream(tokenizer, train_texts)
    held_out = token_stream(tokenizer, held_out_texts)
    log(f"tokenizer: {len(tokenizer)} tokens; {len(stream):,} training tokens, {len(held_out):,} held-out tokens")

    model = make_model(args, len(tokenizer), eot_id)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters, hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads / {args.kv_heads} KV heads, intermediate {args.intermediate}")

    if args.bench:
        args.steps, args.log_every_s, args.eval_every_min, args.warmup_steps = 8, 0.0, 0, 1
        train(args, model, stream, held_out, log)
        return

    stats = train(args, model, stream, held_out, log)
    log(f"trained {stats['steps']} steps, {stats['tokens']:,} tokens in {stats['train_seconds'] / 60:.1f} min, "
        f"final loss {stats['final_loss']:.4f}")

    model = model.to(torch.bfloat16).eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out)
    model = model.float()  # the saved bfloat16 weights, computed in float32 as from_pretrained loads them
    nll, count = held_out_nll(model, held_out, args.seq_len, "fp32")
    ppl = math.exp(nll / count)
    log(f"held-out: {count:,} tokens, loss {nll / count:.4f}, perplexity {ppl:.2f}")

    prompt = tokenizer("def fibonacci(n):", return_tensors="pt")
    samples = {}
    for name, sampling in [("greedy", dict(do_sample=False)),
                           ("temperature 0.3, seed 0", dict(do_sample=True, temperature=0.3, top_p=1.0))]:
        torch.manual_seed(0)
        with torch.no_grad():
            generated = model.generate(**prompt, max_new_tokens=64, pad_token_id=eot_id, **sampling)
        samples[name] = tokenizer.decode(generated[0], skip_special_tokens=True)
        log(f"sample ({name}):\n{samples[name]}")
    held_out_bytes = sum(len(t.encode()) for t in held_out_texts)
    write_card(args.out, args, root, train_files, held_out_files, n_params, model.config, stats, len(stream),
               len(held_out), held_out_bytes, ppl, nll / count, time.perf_counter() - t0, samples)
    (args.out / "training_log.json").write_text(json.dumps(
        {**stats, "held_out_tokens": count, "held_out_loss": nll / count, "held_out_perplexity": ppl,
         "command": sys.argv}, indent=2) + "\n")
    size = sum(p.stat().st_size for p in args.out.iterdir() if p.is_file())
    log(f"saved {args.out} ({size / 1e6:.1f} MB) in {(time.perf_counter() - t0) / 60:.1f} min")


if __name__ == "__main__":
    main()
