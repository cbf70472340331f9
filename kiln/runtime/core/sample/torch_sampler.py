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

Draws are counter-based (rows.py).

0. guided decoding (``SampleRow.allowed``): the tokens the row's grammar refuses are set to
   ``-inf`` before anything else, as vLLM v1 applies its grammar bitmask to the logits;

Logprobs (``params.logprobs``) come from ``log_softmax`` of the RAW logits (vLLM v1), before
penalties and temperature (after the grammar's bitmask, step 0).

``TorchSampler`` is this spec, vectorized over the batch with torch ops: the reference the C++
sampler (sampler.py) is held to, and the sampler wherever that one cannot run.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kiln.runtime.core.sample.rows import (SampleOutput, SampleRow, apply_allowed, call_key, completing_bad_words,
                                           draw_stream, draw_uniform, logprob_dicts)
from kiln.runtime.sampling_params import SamplingParams


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
        raw = apply_allowed(logits if logits.dtype == torch.float32 else logits.float(), rows)
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
            dicts, rk = logprob_dicts(lp, ch, [params[i].logprobs for i in lp_idx], True)
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
        raw = apply_allowed(logits.float(), rows)
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
                ids = completing_bad_words(p.bad_words_ids, r.prompt_token_ids, r.output_token_ids, V)
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
