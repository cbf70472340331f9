"""Trains an EAGLE-3 draft head for Kiln's default model (models/kiln-tiny-stdlib) on the same training
split of the Python standard library, and saves it in the published EAGLE-3 checkpoint format (as
yuhuili/EAGLE3-LLaMA3.1-Instruct-8B and SpecForge write it, as vLLM's llama_eagle3.py loads it).

    python examples/train_eagle3.py --minutes 12 --out models/kiln-tiny-stdlib-eagle3

The head is one Llama decoder layer reading [input_layernorm(embedding of the next token),
hidden_norm(fc(target features))], the features being the target's residual stream entering layers
--aux_layers (HF hidden_states[j]), over a reduced draft vocabulary (d2t / t2d map it to the target's),
with the target's frozen embedding table. It is trained by EAGLE-3's "training-time test" (TTT): unrolled
--ttt_steps times, each step feeding its own pre-norm output back as the next step's hidden input, so it
learns from the features it sees when drafting several tokens ahead, against the target's next-token
distributions. `Eagle3Draft.forward` is the plain draft forward (Kiln's tests import it as an oracle).
"""
import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads collapse on a shared machine
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from torch import nn  # noqa: E402
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_default_model import _cpu_name, learning_rate, split, stdlib_files, token_stream  # noqa: E402


class RMSNorm(nn.Module):
    """As HF Llama: variance in float32, the weight multiplies the normed input cast back to its dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama RoPE (rotate_half convention) on x [..., heads, T, head_dim] at positions [..., T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float32) / half)
    angles = torch.cat([positions[..., None].float() * inv_freq] * 2, -1)[..., None, :, :]  # [..., 1, T, dim]
    return (x * angles.cos() + torch.cat([-x[..., half:], x[..., :half]], -1) * angles.sin()).to(x.dtype)


class Eagle3Draft(nn.Module):
    """The EAGLE-3 head. Attribute names are the checkpoint's tensor names (state_dict() is the file)."""

    def __init__(self, config: dict, d2t: torch.Tensor, t2d: torch.Tensor):
        super().__init__()
        self.config = config
        H, eps = config["hidden_size"], config["rms_norm_eps"]
        self.heads, self.kv_heads, self.head_dim = (config["num_attention_heads"], config["num_key_value_heads"],
                                                    config["head_dim"])
        self.fc = nn.Linear(3 * config["target_hidden_size"], H, bias=False)
        m = self.midlayer = nn.Module()
        m.input_layernorm, m.hidden_norm, m.post_attention_layernorm = RMSNorm(H, eps), RMSNorm(H, eps), RMSNorm(H, eps)
        q_size, kv_size, inter = self.heads * self.head_dim, self.kv_heads * self.head_dim, config["intermediate_size"]
        a, p = m.self_attn, m.mlp = nn.Module(), nn.Module()
        # q/k/v read [input_layernorm(embeds), hidden_norm(hidden)]: twice the width
        a.q_proj, a.k_proj, a.v_proj = (nn.Linear(2 * H, n, bias=False) for n in (q_size, kv_size, kv_size))
        a.o_proj = nn.Linear(q_size, H, bias=False)
        p.gate_proj, p.up_proj, p.down_proj = (nn.Linear(i, o, bias=False)
                                               for i, o in ((H, inter), (H, inter), (inter, H)))
        self.norm, self.lm_head = RMSNorm(H, eps), nn.Linear(H, config["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", d2t.long())  # target_id = draft_id + d2t[draft_id]
        self.register_buffer("t2d", t2d.bool())  # True where a target id is in the draft vocabulary

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype = torch.float32) -> "Eagle3Draft":
        """Loads a saved head (its bfloat16 weights computed in `dtype`)."""
        config = json.loads((Path(path) / "config.json").read_text())
        tensors = load_file(str(Path(path) / "model.safetensors"))
        model = cls(config, tensors["d2t"], tensors["t2d"])
        model.load_state_dict(tensors, strict=True)
        return model.to(dtype).eval()

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def _qkv(self, embeds, hidden_in, positions):
        """Query/key/value of [B, T] positions; hidden_in is fc(target features) or an earlier prenorm."""
        m, (B, T) = self.midlayer, embeds.shape[:2]
        h = torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden_in)], -1)
        a = m.self_attn
        q, k, v = (proj(h).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (a.q_proj, a.k_proj, a.v_proj))
        group = self.heads // self.kv_heads  # GQA: each KV head serves `group` query heads
        theta = self.config["rope_theta"]
        return (rope(q, positions, theta), rope(k, positions, theta).repeat_interleave(group, 1),
                v.repeat_interleave(group, 1))

    def _finish(self, hidden_in, attn):
        """o_proj, residuals and MLP: returns (draft-vocab logits in float32, prenorm hidden)."""
        m = self.midlayer
        B, _, T, _ = attn.shape
        residual = hidden_in + m.self_attn.o_proj(attn.transpose(1, 2).reshape(B, T, -1))
        x = m.post_attention_layernorm(residual)
        prenorm = residual + m.mlp.down_proj(F.silu(m.mlp.gate_proj(x)) * m.mlp.up_proj(x))
        return self.lm_head(self.norm(prenorm)).float(), prenorm

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """One sequence, full causal attention over its T positions, as drafting computes it with a KV cache.

        embeds [T, H]: the target's embedding of the token AFTER each position (for a drafted position, of
        the token drafted at the previous one). hidden: [T, 3 * target_hidden], the target's aux hidden
        states concatenated (fc is applied), or [T, H] already projected (fc(...) rows for target positions,
        the previous position's prenorm output for drafted ones). positions [T]: RoPE positions.
        Returns (logits over the draft vocabulary [T, D] float32, prenorm hidden [T, H])."""
        if hidden.shape[-1] != self.config["hidden_size"]:
            hidden = self.fc(hidden)
        q, k, v = self._qkv(embeds[None], hidden[None], positions[None])
        logits, prenorm = self._finish(hidden[None], F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return logits[0], prenorm[0]

    def ttt_step(self, embeds, hidden_in, positions, cache: list):
        """A batched training-time-test step [B, T]. Step 0 (empty cache) attends causally to itself;
        step s > 0 at base position i attends to step 0's keys at positions <= i and to the keys of steps
        1..s at i, which is what drafting s tokens after position i sees. Appends this step's K/V."""
        q, k, v = self._qkv(embeds, hidden_in, positions)
        scale = self.head_dim ** -0.5
        if not cache:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k0, v0 = cache[0]
            T = q.shape[2]
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
            diag_kv = cache[1:] + [(k, v)]
            scores += [(q * kt).sum(-1, keepdim=True) * scale for kt, _ in diag_kv]
            probs = torch.cat(scores, -1).softmax(-1)
            attn = probs[..., :T] @ v0 + sum(probs[..., T + j, None] * vt for j, (_, vt) in enumerate(diag_kv))
        cache.append((k, v))
        return self._finish(hidden_in, attn)


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, i + n] at position i along dim 1, zero-padded at the end."""
    return x if n == 0 else torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], 1)


@torch.no_grad()
def target_outputs(target, batch: torch.Tensor, aux_layers: list[int]):
    out = target(input_ids=batch, output_hidden_states=True)
    return torch.cat([out.hidden_states[j] for j in aux_layers], -1), out.logits.float()


def ttt_losses(draft, embed, batch, aux, target_logits, draft_ids, steps: int):
    """Per-TTT-step soft cross-entropy against the target (restricted to the draft vocabulary), weighted
    0.8 ** s as in EAGLE-3, and top-1 agreement with the target's argmax (a miss when that argmax is
    outside the draft vocabulary). Step s at base position i is absolute position i + s: it embeds token
    i + 1 + s and is taught the target's distribution at i + 1 + s (for token i + 2 + s)."""
    B, T = batch.shape
    teacher = target_logits[..., draft_ids].softmax(-1)
    argmax = target_logits.argmax(-1)  # as a draft id (cumsum counts the draft tokens up to it), or -1
    target_argmax_draft = torch.where(draft.t2d[argmax], torch.cumsum(draft.t2d.long(), 0)[argmax] - 1, -1)
    hidden, cache, total, accs = draft.fc(aux), [], 0.0, []
    base = torch.arange(T).expand(B, T)
    for s in range(steps):
        valid = (base <= T - 2 - s).float()
        logits, hidden = draft.ttt_step(embed[shift(batch, 1 + s)], hidden, base + s, cache)
        loss = -(shift(teacher, 1 + s) * logits.log_softmax(-1)).sum(-1)
        total = total + 0.8 ** s * (loss * valid).sum() / valid.sum()
        hit = (logits.argmax(-1) == shift(target_argmax_draft, 1 + s)).float()
        accs.append(((hit * valid).sum() / valid.sum()).item())
    return total, accs


@torch.no_grad()
def acceptance(draft, target, embed, held_out, aux_layers, n_positions, context, k_max, seed):
    """Greedy chain drafting of k_max tokens after random held-out positions against the target's greedy
    continuation. Returns mean accepted + 1 for each k = 1..k_max."""
    ends = torch.randint(context - 1, len(held_out) - 1, (n_positions,),
                         generator=torch.Generator().manual_seed(seed))
    ctx = torch.stack([held_out[e - context + 1:e + 1] for e in ends.tolist()])
    accepted = torch.zeros(n_positions, k_max, dtype=torch.long)
    for chunk in torch.split(torch.arange(n_positions), 32):
        x = ctx[chunk]
        out = target(input_ids=x, output_hidden_states=True, use_cache=True)
        aux = torch.cat([out.hidden_states[j] for j in aux_layers], -1)
        greedy = [out.logits[:, -1].argmax(-1)]
        for _ in range(k_max):  # the target's own greedy continuation g1 .. g(k_max + 1)
            out = target(input_ids=greedy[-1][:, None], past_key_values=out.past_key_values, use_cache=True)
            greedy.append(out.logits[:, -1].argmax(-1))
        greedy = torch.stack(greedy, 1)
        # The sequence the draft sees: each context position embeds its next token (the last one, g1, is the
        # token the target just verified); drafted positions append (embedding of the draft, prenorm).
        embeds = embed[torch.cat([x[:, 1:], greedy[:, :1]], 1)]
        hidden, drafted = draft.fc(aux), []
        for _ in range(k_max):
            logits, prenorm = zip(*[draft(e, h, torch.arange(e.shape[0])) for e, h in zip(embeds, hidden)])
            drafted.append(draft.draft_to_target(torch.stack(logits)[:, -1].argmax(-1)))
            embeds = torch.cat([embeds, embed[drafted[-1]][:, None]], 1)
            hidden = torch.cat([hidden, torch.stack(prenorm)[:, -1:]], 1)
        match = (torch.stack(drafted, 1) == greedy[:, 1:]).long()
        accepted[chunk] = match.cumprod(1).cumsum(1)  # accepted among the first k, for each k
    return (accepted.float().mean(0) + 1).tolist()


def make_config(args, target_config, draft_vocab_size: int) -> dict:
    """The published EAGLE-3 config: a one-layer Llama of the target's width, attention and RoPE."""
    same = ["hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
            "max_position_embeddings", "vocab_size", "bos_token_id", "eos_token_id"]
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            **{k: getattr(target_config, k) for k in same}, "intermediate_size": args.intermediate,
            "hidden_act": "silu", "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "target_hidden_size": target_config.hidden_size,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": args.aux_layers, "use_aux_hidden_state": True}}


def choose_draft_vocab(target, stream, size, aux_layers, seq_len, rng) -> torch.Tensor:
    """The `size` most frequent tokens, scored by their frequency in the training stream plus their
    frequency as the target's argmax on a sample of it: what the head must be able to propose is what
    the target predicts, which is more concentrated than the data. Sorted, so d2t >= 0 as SpecForge's."""
    score = torch.bincount(stream, minlength=target.config.vocab_size).float() / len(stream)
    offsets = torch.randint(0, len(stream) - seq_len, (64,), generator=rng)
    sample = torch.stack([stream[o:o + seq_len] for o in offsets.tolist()])
    predicted = torch.cat([target_outputs(target, b, aux_layers)[1].argmax(-1).flatten() for b in sample.split(8)])
    score += torch.bincount(predicted, minlength=target.config.vocab_size).float() / len(predicted)
    score[target.config.bos_token_id] = float("inf")  # documents end with it
    return score.topk(size).indices.sort().values


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=Path("models/kiln-tiny-stdlib"))
    p.add_argument("--out", type=Path, default=Path("models/kiln-tiny-stdlib-eagle3"))
    p.add_argument("--minutes", type=float, default=12.0, help="wall-clock training budget")
    p.add_argument("--aux_layers", type=int, nargs=3, default=[1, 3, 5],
                   help="target layers whose input residual stream the head reads (HF hidden_states[j])")
    p.add_argument("--draft_vocab", type=int, default=2048, help="draft vocabulary size (the target's: 8192)")
    p.add_argument("--eval_windows", type=int, default=32, help="held-out windows for teacher-forced accuracy")
    p.add_argument("--eval_positions", type=int, default=512, help="held-out positions for acceptance length")
    p.add_argument("--eval_context", type=int, default=128, help="context tokens before each of those")
    for name, default in dict(intermediate=704, ttt_steps=4, seq_len=256, batch_size=8, lr=2e-3, min_lr=2e-4,
                              warmup_steps=50, weight_decay=0.01, threads=2, seed=0, log_every_s=30.0).items():
        p.add_argument(f"--{name}", type=type(default), default=default)
    args = p.parse_args()
    t0 = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = torch.Generator().manual_seed(args.seed)

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:7.1f}s] {msg}", flush=True)

    target = LlamaForCausalLM.from_pretrained(args.target, torch_dtype=torch.float32).eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    embed = target.model.embed_tokens.weight  # the head shares the target's (frozen) table
    _, files = stdlib_files()
    train_files, held_out_files = split(files)
    stream = token_stream(tokenizer, [f.read_text(encoding="utf-8") for f in train_files])
    held_out = token_stream(tokenizer, [f.read_text(encoding="utf-8") for f in held_out_files])
    log(f"{len(stream):,} training tokens, {len(held_out):,} held-out tokens")

    draft_ids = choose_draft_vocab(target, stream, args.draft_vocab, args.aux_layers, args.seq_len, rng)
    t2d = torch.zeros(target.config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True)
    config = make_config(args, target.config, args.draft_vocab)
    draft = Eagle3Draft(config, draft_ids - torch.arange(args.draft_vocab), t2d)
    in_vocab = torch.bincount(stream, minlength=len(t2d))[t2d].sum() / len(stream)
    log(f"draft vocabulary: {args.draft_vocab} tokens, {in_vocab:.2%} of training tokens; "
        f"head: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M parameters")
    with torch.no_grad():
        # Warm start in the target's space: the head starts as an early exit of the target (fc passes the
        # last aux layer through, then the target's final norm and its LM head rows), and small
        # residual-branch outputs leave that path intact until training reshapes it.
        H = config["hidden_size"]
        draft.fc.weight.zero_()[:, 2 * H:] = torch.eye(H)
        draft.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        draft.norm.weight.copy_(target.model.norm.weight)
        for lin in (draft.midlayer.self_attn.o_proj, draft.midlayer.mlp.down_proj):
            lin.weight.normal_(0, 0.02 * 2 ** -0.5)

    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
                                   {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))
    budget, start = args.minutes * 60, time.perf_counter()
    step, tokens, smoothed, last_log, loads = 0, 0, None, start, []
    while (elapsed := time.perf_counter() - start) < budget:
        lr = learning_rate(args, step, elapsed / budget)
        for group in optimizer.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(stream) - args.seq_len, (args.batch_size,), generator=rng)
        batch = torch.stack([stream[o:o + args.seq_len] for o in offsets.tolist()])
        aux, logits = target_outputs(target, batch, args.aux_layers)
        loss, accs = ttt_losses(draft, embed, batch, aux, logits, draft_ids, args.ttt_steps)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, tokens = step + 1, tokens + batch.numel()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if (now := time.perf_counter()) - last_log >= args.log_every_s or step == 1:
            loads.append(os.getloadavg()[0])
            log(f"step {step:5d}  loss {loss.item():.3f}  avg {smoothed:.3f}  top-1 per TTT step "
                f"{' '.join(f'{a:.2f}' for a in accs)}  lr {lr:.1e}  {tokens / (now - start):5.0f} tok/s")
            last_log = now
    train_seconds = time.perf_counter() - start
    log(f"trained {step} steps, {tokens:,} tokens in {train_seconds / 60:.1f} min")

    args.out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() if k in ("d2t", "t2d") else v.to(torch.bfloat16).contiguous()
             for k, v in draft.state_dict().items()}
    save_file(state, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    (args.out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # Evaluate what was saved: the bfloat16 weights reloaded, computed in float32.
    draft = Eagle3Draft.from_pretrained(args.out)
    with torch.no_grad():
        windows = [held_out[s:s + args.seq_len] for s in range(0, len(held_out) - args.seq_len, args.seq_len)]
        outputs = [(w[None], *target_outputs(target, w[None], args.aux_layers)) for w in windows[:args.eval_windows]]
        top1 = torch.tensor([ttt_losses(draft, embed, *o, draft_ids, args.ttt_steps)[1] for o in outputs])
    top1 = top1.mean(0).tolist()
    accept = acceptance(draft, target, embed, held_out, args.aux_layers, args.eval_positions,
                        args.eval_context, 4, args.seed)
    log(f"held-out teacher-forced top-1 per TTT step: {top1}; mean acceptance length k=1..4: {accept}")
    coverage = t2d[torch.cat([o[2].argmax(-1).flatten() for o in outputs])].float().mean().item()
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    record = {"steps": step, "tokens": tokens, "train_seconds": train_seconds, "final_loss": smoothed,
              "tokens_per_s": tokens / train_seconds, "mean_load_average": sum(loads) / len(loads),
              "held_out_top1_per_ttt_step": top1, "held_out_mean_acceptance_length": dict(zip(range(1, 5), accept)),
              "held_out_target_argmax_in_draft_vocab": coverage, "eval_positions": args.eval_positions,
              "eval_context": args.eval_context, "eval_windows": len(outputs),
              "wall_seconds": time.perf_counter() - t0, "command": sys.argv}
    (args.out / "training_log.json").write_text(json.dumps(record, indent=2) + "\n")
    write_card(args, config, record, command)
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    log(f"saved {args.out} ({size / 1e6:.1f} MB) in {(time.perf_counter() - t0) / 60:.1f} min")


def write_card(args, c: dict, r: dict, command: str) -> None:
    n_params = sum(v.numel() for k, v in load_file(args.out / "model.safetensors").items() if v.is_floating_point())
    row = lambda values, fmt: " | ".join(fmt.format(v) for v in values)  # noqa: E731
    accept, D = r["held_out_mean_acceptance_length"], c["draft_vocab_size"]
    (args.out / "README.md").write_text(f"""# kiln-tiny-stdlib-eagle3

An EAGLE-3 draft head ({n_params / 1e6:.2f}M parameters, bfloat16) for [kiln-tiny-stdlib](../kiln-tiny-stdlib),
Kiln's default model, for speculative decoding. Like that model it exists so that Kiln's EAGLE-3 code paths
have real, redistributable weights; it only knows the style of the Python standard library.

## Format

The published EAGLE-3 checkpoint format (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge; loaded by vLLM's
`llama_eagle3.py`): `config.json` (`LlamaForCausalLMEagle3`, one layer) and `model.safetensors` with `fc`
[{c['hidden_size']}, 3 x {c['target_hidden_size']}], `midlayer.*` (a Llama decoder layer whose q/k/v projections read
[input_layernorm(next-token embedding), hidden_norm(hidden input)]), `norm`, `lm_head` over a {D}-token
draft vocabulary, `d2t` (int64: target id = draft id + d2t[draft id]) and `t2d` (bool over the
{c['vocab_size']} target ids). No embedding table: the head uses the target's. Its features are the target's
residual stream entering layers {c['eagle_config']['eagle_aux_hidden_state_layer_ids']} (`eagle_aux_hidden_state_layer_ids`, HF
`hidden_states[j]`), concatenated in that order. `Eagle3Draft` in `examples/train_eagle3.py` is a reference
implementation of its forward.

## Training

```
{command}
```

{r['steps']:,} steps of {args.batch_size} x {args.seq_len}-token windows ({r['tokens']:,} tokens) of the default model's
training split in {r['train_seconds'] / 60:.1f} min on {torch.get_num_threads()} CPU threads ({platform.machine()},
{_cpu_name()}; mean load average {r['mean_load_average']:.1f}). Training-time test with {args.ttt_steps} unrolled
steps, each feeding the head's own pre-norm output back; loss: cross-entropy against the target's next-token
distribution restricted to the draft vocabulary, step s weighted 0.8^s. AdamW, peak learning rate {args.lr:g},
cosine to {args.min_lr:g} over the budget; fc, the final norm and the LM head start from the target (an early
exit). The draft vocabulary is the {D} tokens most frequent in the training data and among the target's
argmax predictions; it holds the target's argmax at {r['held_out_target_argmax_in_draft_vocab']:.2%} of held-out positions.

## Held-out results

On the default model's held-out files. Mean acceptance length (accepted drafts + 1) of greedy chain
drafting of k tokens against the target's greedy continuation, after {r['eval_positions']} random positions
with {r['eval_context']} tokens of context; and teacher-forced top-1 agreement with the target's argmax at TTT
step s (drafting s tokens ahead of the target's features; {r['eval_windows']} windows of {args.seq_len} tokens):

| k | {row(accept, "{}")} |
|---|{'---|' * len(accept)}
| mean acceptance length | {row(accept.values(), "{:.3f}")} |

| TTT step s | {row(range(1, args.ttt_steps + 1), "{}")} |
|---|{'---|' * args.ttt_steps}
| top-1 | {row(r['held_out_top1_per_ttt_step'], "{:.1%}")} |

## Data and license

The same data as kiln-tiny-stdlib: the training split of CPython's standard library `.py` files,
distributed under the Python Software Foundation License Version 2 (<https://docs.python.org/3/license.html>).
""")


if __name__ == "__main__":
    main()
