"""Batched token sampler over float32 logits (vLLM semantics).

Order of operations for each row, as vLLM:

1. ``min_tokens``: while ``len(output) < min_tokens`` the stop token ids (and the EOS ids, unless
   ``ignore_eos``) are set to ``-inf``; so is the last token of each ``bad_words_ids`` word whose
   other tokens end the sequence (prompt + output);
2. repetition penalty over prompt + output tokens (HF: ``logit > 0 -> logit / p`` else ``* p``);
3. frequency and presence penalties over output tokens (OpenAI:
   ``logit -= count * frequency + (count > 0) * presence``);
4. greedy rows (temperature ~0 or top_k == 1) take the argmax of the penalized logits;
5. the others: divide by temperature, top-k (ties with the k-th value are kept), top-p (smallest
   set of top tokens whose probability reaches p), min-p (drop tokens with
   ``prob < min_p * max_prob``), then sample by inverse CDF (one uniform draw per row).

A draw's uniform is a hash of (seed, stream, output position): for a seeded row (its
``generator``, from ``make_generator(seed, index)``) the request's seed and the sample's index, so
seeded rows are reproducible whatever else is in the batch, with no state to carry (a preempted and
recomputed sequence draws the same again); for the others a key drawn once per call from torch's
default generator and the row's place in the batch.

Logprobs (``params.logprobs``) come from ``log_softmax`` of the RAW logits (vLLM v1), before
penalties and temperature.

``TorchSampler`` is this spec, vectorized over the batch with torch ops; ``Sampler`` runs the
kiln_cpp library's sampler (kiln/plugins/csrc/sampler.cpp: one call a batch, a few passes a row, no
sort of the vocabulary, top-p by rejection sampling, so its seeded draws differ from this one's
wherever top-p cuts) when the library loads and the logits are on the CPU, ``TorchSampler``
otherwise.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Sequence

import torch

from kiln.runtime.sampling_params import SamplingParams

__all__ = ["SampleRow", "SampleOutput", "Sampler", "TorchSampler", "SeedGenerator", "compute_prompt_logprobs",
           "make_generator"]


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


@dataclass
class SampleOutput:
    token_ids: list[int]  # one per row
    # Per row when params.logprobs is not None: {sampled token: logprob, then the top-n tokens}.
    logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Per row when params.logprobs is not None: 1-based rank of the sampled token in the raw
    # distribution (1 + number of tokens with a strictly larger logprob).
    ranks: list[int | None] = field(default_factory=list)


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


def _logprob_dicts(lp: torch.Tensor, chosen: torch.Tensor, top_ns: list[int],
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
    out, _ = _logprob_dicts(lp, nxt, [top_n] * logits.shape[0], want_ranks=False)
    return out


def _completing_bad_words(words: list[list[int]], prompt: Sequence[int], output: Sequence[int],
                          vocab: int) -> list[int]:
    """The tokens that would complete a bad word now (its other tokens end prompt + output)."""
    k = max(len(w) for w in words) - 1
    tail = [*prompt[max(len(prompt) - k, 0):], *output[max(len(output) - k, 0):]][-k:] if k else []
    return sorted({w[-1] for w in words
                   if w[-1] < vocab and (len(w) == 1 or tail[len(tail) - len(w) + 1:] == w[:-1])})


# Top-p looks for its nucleus among this many most likely tokens first: a partial top-k instead of
# sorting the whole vocabulary, which at 64 rows x 32k tokens costs more than a decode step.
TOP_P_CANDIDATES = 1024


def top_p_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] bool: the tokens outside each row's nucleus, the smallest set of most likely tokens
    whose probability reaches top_p[r] (the most likely token is always kept)."""
    R, V = logits.shape
    probs = logits.softmax(dim=-1)
    vals, idx = probs.topk(min(V, TOP_P_CANDIDATES), dim=-1)  # descending
    keep = vals.cumsum(dim=-1) - vals < top_p.unsqueeze(1)  # probability before the token < p
    keep[:, 0] = True
    drop = torch.ones_like(probs, dtype=torch.bool).scatter_(1, idx, ~keep)
    # Flat rows whose candidates do not reach p take the full sort.
    flat = (keep[:, -1] & (vals.sum(dim=-1) < top_p) & (top_p < 1)).nonzero().flatten()
    if len(flat) and V > vals.shape[1]:
        srt, order = probs[flat].sort(dim=-1, descending=True)
        keep = srt.cumsum(dim=-1) - srt < top_p[flat].unsqueeze(1)
        keep[:, 0] = True
        drop[flat] = torch.empty_like(keep).scatter_(1, order, ~keep)
    drop[top_p >= 1] = False  # rows of a batch that do not use top-p
    return drop


class TorchSampler:
    """The reference sampler (the spec above) in torch ops, on any device.
    ``TorchSampler()(logits [N, V], rows) -> SampleOutput``. Does not modify ``logits``."""

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                             f"got shape {tuple(logits.shape)}")
        N, V = logits.shape
        if N == 0:
            return SampleOutput([], [], [])
        device = logits.device
        raw = logits if logits.dtype == torch.float32 else logits.float()
        params = [r.params for r in rows]
        x = self._process(raw, rows)  # `raw` itself when nothing changes it

        # ---- 4. greedy rows ---------------------------------------------------------------
        greedy = [p.greedy for p in params]
        if all(greedy):
            sampled = x.argmax(dim=-1)
        else:
            sampled = torch.empty(N, dtype=torch.long, device=device)
            g_idx = [i for i in range(N) if greedy[i]]
            s_idx = [i for i in range(N) if not greedy[i]]
            if g_idx:
                gi = torch.tensor(g_idx, device=device)
                sampled[gi] = x[gi].argmax(dim=-1)
            key = call_key(rows)
            if len(s_idx) == N:
                sampled = self._sample(x.clone() if x is raw else x, rows, s_idx, key)
            else:
                si = torch.tensor(s_idx, device=device)
                sampled[si] = self._sample(x[si], rows, s_idx, key)

        # ---- logprobs from the raw logits -------------------------------------------------
        token_ids = sampled.tolist()
        logprobs: list[dict[int, float] | None] = [None] * N
        ranks: list[int | None] = [None] * N
        lp_idx = [i for i, p in enumerate(params) if p.logprobs is not None]
        if lp_idx:
            if len(lp_idx) == N:
                sub, ch = raw, sampled
            else:
                li = torch.tensor(lp_idx, device=device)
                sub, ch = raw[li], sampled[li]
            lp = torch.log_softmax(sub, dim=-1)
            dicts, rk = _logprob_dicts(lp, ch, [params[i].logprobs for i in lp_idx], True)
            for j, i in enumerate(lp_idx):
                logprobs[i] = dicts[j]
                ranks[i] = rk[j]
        return SampleOutput(token_ids, logprobs, ranks)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """The logits after min_tokens masking and the penalties (steps 1-3), as a new float32
        tensor: what greedy rows take the argmax of, before temperature/top-k/top-p/min-p."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], "
                             f"got shape {tuple(logits.shape)}")
        raw = logits.float()
        x = self._process(raw, rows)
        return x.clone() if x is logits else x

    def _process(self, raw: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """Steps 1-3; returns ``raw`` itself when no row needs them, else a modified copy."""
        device, V = raw.device, raw.shape[1]
        x = raw
        # ---- 1. min_tokens: mask stop ids (and EOS unless ignore_eos) ----------------------
        mr, mt = [], []
        for i, r in enumerate(rows):
            p = r.params
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
                ids = list(p.stop_token_ids)
                if not p.ignore_eos:
                    ids.extend(r.eos_token_ids)
                ids = [t for t in set(ids) if 0 <= t < V]
                mr.extend([i] * len(ids))
                mt.extend(ids)
            if p.bad_words_ids:
                ids = _completing_bad_words(p.bad_words_ids, r.prompt_token_ids, r.output_token_ids, V)
                mr.extend([i] * len(ids))
                mt.extend(ids)
        if mr:
            x = raw.clone()
            x[torch.tensor(mr, device=device), torch.tensor(mt, device=device)] = float("-inf")

        # ---- 2./3. penalties --------------------------------------------------------------
        pen = [i for i, r in enumerate(rows) if r.params.uses_penalties]
        if pen:
            x = self._apply_penalties(raw.clone() if x is raw else x, rows, pen)
        return x

    # ------------------------------------------------------------------------------------
    @staticmethod
    def _apply_penalties(x: torch.Tensor, rows: Sequence[SampleRow],
                         pen: list[int]) -> torch.Tensor:
        """In place on x (already a private copy) for rows ``pen``."""
        device, V = x.device, x.shape[1]
        M = len(pen)
        params = [rows[i].params for i in pen]
        sub = x if M == x.shape[0] else x[torch.tensor(pen, device=device)]

        # output token counts [M, V] by scatter_add on a zero tensor
        out_rows, out_toks = [], []
        for j, i in enumerate(pen):
            toks = rows[i].output_token_ids
            out_rows.extend([j] * len(toks))
            out_toks.extend(toks)
        counts = torch.zeros((M, V), dtype=torch.float32, device=device)
        if out_toks:
            counts.index_put_((torch.tensor(out_rows, device=device),
                               torch.tensor(out_toks, device=device)),
                              torch.ones(len(out_toks), device=device), accumulate=True)

        rep = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in rep):
            seen = counts > 0
            pr, pt = [], []
            for j, i in enumerate(pen):
                if params[j].repetition_penalty != 1.0:
                    toks = rows[i].prompt_token_ids
                    pr.extend([j] * len(toks))
                    pt.extend(toks)
            if pt:
                seen[torch.tensor(pr, device=device), torch.tensor(pt, device=device)] = True
            rp = torch.tensor(rep, dtype=torch.float32, device=device).unsqueeze(1)
            penalized = torch.where(sub > 0, sub / rp, sub * rp)
            sub = torch.where(seen, penalized, sub)

        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        if out_toks and (any(freq) or any(pres)):
            if any(freq):
                sub = sub - torch.tensor(freq, device=device).unsqueeze(1) * counts
            if any(pres):
                sub = sub - torch.tensor(pres, device=device).unsqueeze(1) * (counts > 0).float()

        if M == x.shape[0]:
            return sub
        x[torch.tensor(pen, device=device)] = sub
        return x

    @staticmethod
    def _sample(s: torch.Tensor, rows: Sequence[SampleRow], s_idx: list[int], key: int) -> torch.Tensor:
        """Sample one token per row of ``s`` (a private [K, V] copy, modified in place)."""
        V = s.shape[1]
        TorchSampler.truncate(s, [rows[i].params for i in s_idx])
        # Inverse CDF: one uniform draw per row (V exponentials per row cost ~10x more on CPU), the
        # CDF in float64 so that no token's interval is lost to rounding in a large vocabulary.
        cdf = s.softmax(dim=-1).cumsum(dim=-1, dtype=torch.float64)
        u = torch.tensor([draw_uniform(*draw_stream(rows[i], i, key), len(rows[i].output_token_ids))
                          for i in s_idx], dtype=torch.float64, device=s.device).unsqueeze(1)
        # right=True: the first token whose interval ends past u, so a token of probability 0 (an
        # interval of width 0) is never drawn.
        token = torch.searchsorted(cdf, u.mul_(cdf[:, -1:]), right=True).squeeze(1)
        return token.clamp_(max=V - 1)

    @staticmethod
    def truncate(s: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """Step 5 before the draw, in place on the penalized logits ``s`` (one row per params):
        temperature, then -inf outside each row's top-k, top-p and min-p sets. Its softmax is the
        distribution a sampled row is drawn from (speculative decoding verifies against it)."""
        device, V = s.device, s.shape[1]
        ninf = float("-inf")

        temps = [p.temperature for p in params]
        if any(t != 1.0 for t in temps):
            s.div_(torch.tensor(temps, dtype=torch.float32, device=device).unsqueeze(1))

        ks = [p.top_k if 0 < p.top_k < V else V for p in params]
        need_k = any(k < V for k in ks)
        ps = [p.top_p for p in params]
        need_p = any(p < 1.0 for p in ps)
        if need_k:
            top = s.topk(max(ks), dim=-1).values
            thr = top.gather(1, torch.tensor(ks, device=device).unsqueeze(1) - 1)
            s.masked_fill_(s < thr, ninf)
        if need_p:
            s.masked_fill_(top_p_drop(s, torch.tensor(ps, dtype=torch.float32, device=device)), ninf)

        mps = [p.min_p for p in params]
        if any(mps):
            # prob_i < min_p * max_prob  <=>  logit_i - max_logit < log(min_p)
            mx = s.max(dim=-1, keepdim=True).values
            logmp = torch.tensor(mps, dtype=torch.float32, device=device).log().unsqueeze(1)
            s.masked_fill_(s - mx < logmp, ninf)
        return s


BACKENDS = ("auto", "cpp", "torch")
_cpp_unavailable: str | None = None  # why the C++ sampler cannot load here, once known


def _cpp_loads() -> bool:
    global _cpp_unavailable
    if _cpp_unavailable is None:
        from kiln.plugins import cpp
        try:
            cpp.load()
            _cpp_unavailable = ""
        except cpp.PluginBuildError as e:
            _cpp_unavailable = str(e)
            warnings.warn(f"kiln: the C++ sampler is unavailable, sampling with torch ops instead: {e}",
                          RuntimeWarning, stacklevel=4)
    return not _cpp_unavailable


class Sampler:
    """``Sampler(backend)(logits [N, V], rows) -> SampleOutput``, the spec above. Does not modify
    ``logits``. backend: "cpp" (kiln_cpp's sampler; CPU logits), "torch" (``TorchSampler``), or
    "auto" (the default, or $KILN_SAMPLER): cpp for CPU logits where the library builds and loads
    (built once, by `make install` or on first use), torch otherwise, with a warning saying why."""

    def __init__(self, backend: str | None = None):
        backend = backend or os.environ.get("KILN_SAMPLER") or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"sampler backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        if backend == "cpp":
            from kiln.plugins import cpp
            cpp.load()  # a PluginBuildError says why not
        from kiln.runtime import sampler_cpp  # packs rows for the op; imports this module

        self.backend = backend
        self.reference = TorchSampler()
        self.cpp = sampler_cpp

    def _use_cpp(self, logits: torch.Tensor) -> bool:
        if self.backend == "torch":
            return False
        if logits.device.type != "cpu":
            if self.backend == "cpp":
                raise ValueError(f"the cpp sampler takes CPU logits, got logits on {logits.device}")
            return False
        return self.backend == "cpp" or _cpp_loads()

    def __call__(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleOutput:
        if not self._use_cpp(logits):
            return self.reference(logits, rows)
        return self.cpp.sample(logits, rows)

    def process_logits(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
        """The logits after min_tokens masking and the penalties (steps 1-3), as a new float32
        tensor: what greedy rows take the argmax of, before temperature/top-k/top-p/min-p."""
        if not self._use_cpp(logits):
            return self.reference.process_logits(logits, rows)
        return self.cpp.process_logits(logits, rows)
