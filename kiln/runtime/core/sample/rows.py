"""What a sampler takes and returns, and its draws.

A draw's uniform is a hash of (seed, stream, output position): for a seeded row (its
``generator``, from ``make_generator(seed, index)``) the request's seed and the sample's index, so
seeded rows are reproducible whatever else is in the batch, with no state to carry (a preempted and
recomputed sequence draws the same again); for the others a key drawn once per call from torch's
default generator and the row's place in the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kiln.runtime.sampling_params import SamplingParams


@dataclass(frozen=True)
class SeedGenerator:
    """A seeded sample's draws: counter-based, the uniform for output position t is a hash of
    (seed, index, t), so it needs no state and two samples of one request are independent."""

    seed: int
    index: int = 0  # which of the request's n samples


@dataclass
class SampleRow:
    """One row of logits to sample from."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated so far by this sequence
    generator: SeedGenerator | None = None  # a seeded request's draws; None = the process RNG
    eos_token_ids: tuple[int, ...] = ()
    # Guided decoding: the tokens its grammar allows, a [ceil(V / 32)] int32 bitmask (bit t % 32 of
    # word t // 32: token t), applied to the logits before anything else; None: every token.
    allowed: torch.Tensor | None = None


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    # Per row when params.logprobs is not None: {sampled token: logprob, then the top-n tokens}.
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Per row when params.logprobs is not None: 1-based rank of the sampled token in the raw
    # distribution (1 + number of tokens with a strictly larger logprob).
    ranks: list[int | None] = field(default_factory=list)


def apply_allowed(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """logits with -inf where a row's grammar bitmask refuses the token: logits itself when no row
    has one, else a copy."""
    guided = [i for i, r in enumerate(rows) if r.allowed is not None]
    if not guided:
        return logits
    V = logits.shape[1]
    words = torch.stack([rows[i].allowed for i in guided]).to(logits.device)
    bits = (words.unsqueeze(-1) >> torch.arange(32, device=logits.device, dtype=words.dtype)) & 1
    refused = bits.flatten(1)[:, :V] == 0
    out = logits.clone()
    index = torch.tensor(guided, device=logits.device)
    out[index] = out[index].masked_fill(refused, float("-inf"))
    return out


def make_generator(seed: int, index: int = 0) -> SeedGenerator:
    """The draws of sample ``index`` of a request seeded with ``seed`` (any int)."""
    return SeedGenerator(seed, index)


_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _absorb(h: int, word: int) -> int:
    """splitmix64's mix of (h ^ word) + gamma; sampler_kernel.h has the same."""
    z = ((h ^ (word & _M64)) + _GAMMA) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def draw_uniform(seed: int, stream: int, position: int, round: int = 0) -> float:
    """The uniform in [0, 1) (53 bits) of draw ``round`` at output ``position`` of (seed, stream)."""
    h = _GAMMA
    for word in (seed, stream, position):
        h = _absorb(h, word)
    return (_absorb(h, round) >> 11) * 2.0 ** -53


def call_key(rows: Sequence[SampleRow]) -> int:
    """The key of a call's unseeded sampled rows: one draw from torch's default generator, made only
    when the call has such a row (seeded and greedy batches leave the generator alone)."""
    if any(r.generator is None and not r.params.greedy for r in rows):
        return int(torch.empty((), dtype=torch.int64).random_())
    return 0


def draw_stream(row: SampleRow, j: int, key: int) -> tuple[int, int]:
    """(seed, stream) of row ``j`` of a batch: its generator's, or the call's key and ``j``."""
    g = row.generator
    if g is None:
        return key, j
    if not isinstance(g, SeedGenerator):
        raise TypeError(f"SampleRow.generator must be a SeedGenerator (make_generator(seed, index)) or "
                        f"None, got {type(g).__name__}")
    return g.seed, g.index


def logprob_dicts(lp: torch.Tensor, chosen: torch.Tensor, top_ns: list[int],
                   want_ranks: bool) -> tuple[list[dict[int, float]], list[int] | None]:
    """lp [R, V] log-probs, chosen [R] token ids -> per row {chosen: lp, top-n...} (+ ranks)."""
    chosen_lp = lp.gather(1, chosen.unsqueeze(1)).squeeze(1)
    max_n = max(top_ns) if top_ns else 0
    if max_n > 0:
        top_v, top_i = lp.topk(min(max_n, lp.shape[1]), dim=1)
        top_v, top_i = top_v.tolist(), top_i.tolist()
    ranks = None
    if want_ranks:
        ranks = ((lp > chosen_lp.unsqueeze(1)).sum(dim=1) + 1).tolist()
    chosen_l, chosen_lp_l = chosen.tolist(), chosen_lp.tolist()
    out = []
    for r, n in enumerate(top_ns):
        d = {chosen_l[r]: chosen_lp_l[r]}
        for j in range(n):
            d.setdefault(top_i[r][j], top_v[r][j])
        out.append(d)
    return out, ranks


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: Sequence[int] | torch.Tensor,
                            top_n: int) -> list[dict[int, float]]:
    """Prompt logprobs: for each position p, {next_token_ids[p]: logprob, then the top-n tokens},
    from ``log_softmax(logits[p])`` (raw logits, float32)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be 2-D [P, vocab], got shape {tuple(logits.shape)}")
    nxt = torch.as_tensor(next_token_ids, dtype=torch.long, device=logits.device).reshape(-1)
    if nxt.shape[0] != logits.shape[0]:
        raise ValueError(f"next_token_ids must have {logits.shape[0]} entries (one per logits "
                         f"row), got {nxt.shape[0]}")
    if top_n < 0:
        raise ValueError(f"top_n must be >= 0, got {top_n}")
    if logits.shape[0] == 0:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)
    out, _ = logprob_dicts(lp, nxt, [top_n] * logits.shape[0], want_ranks=False)
    return out


def completing_bad_words(words: list[list[int]], prompt: Sequence[int], output: Sequence[int],
                          vocab: int) -> list[int]:
    """The tokens that would complete a bad word now (its other tokens end prompt + output)."""
    k = max(len(w) for w in words) - 1
    tail = [*prompt[max(len(prompt) - k, 0):], *output[max(len(output) - k, 0):]][-k:] if k else []
    return sorted({w[-1] for w in words
                   if w[-1] < vocab and (len(w) == 1 or tail[len(tail) - len(w) + 1:] == w[:-1])})
