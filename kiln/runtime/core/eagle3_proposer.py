"""EAGLE-3 proposals (kiln/models/eagle3.py): the draft layer follows each target sequence on a KV
pool of its own, reading the target's hidden states, which an engine built for EAGLE-3 returns for
every token it computes (`observe`).

Draft position p reads the token at p + 1 and the target's fused state at p, so with the target's
states known for positions [0, C) (C: the tokens it has computed; the last token is pending) the
draft catches up over the positions it has not seen, [M, C), whose last row drafts the token after
the pending one. Each further draft feeds back the draft's own pre-norm output. The draft's K/V at
positions >= C came from its own states and is overwritten by the next catch-up, as the target's K/V
of rejected drafts is.

Positions whose target states were never computed here (a prefix-cache hit) are read as zeros: the
draft's proposals for that request get worse, never the output.
"""
from __future__ import annotations

from pathlib import Path

import torch

from kiln.config import ConfigError
from kiln.models.eagle3 import DRAFT_DIR, Eagle3Draft
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.core.step_plan import plan_step
from kiln.runtime.sampling_params import SamplingParams

class _Follower:
    """One target sequence's draft: its draft sequence (tokens shifted by one) and the target states
    of the positions not yet read into the draft's KV, as the steps returned them: (first position,
    rows) chunks, joined only when the draft reads them (a sequence that drafts nothing for many steps
    costs a slice per step, not a copy of its history)."""

    def __init__(self, seq: Sequence):
        req = Request("eagle3", [], SamplingParams(), seq.request.max_tokens)
        self.draft = Sequence(req, 0, [])
        self.chunks: list[tuple[int, torch.Tensor]] = []

    def put(self, start: int, rows: torch.Tensor) -> None:
        """States from `start` on: what was kept for those positions (rejected drafts') is replaced."""
        chunks = self.chunks  # in position order: only the last few can reach past start
        while chunks and chunks[-1][0] >= start:
            chunks.pop()
        if chunks and chunks[-1][0] + chunks[-1][1].shape[0] > start:
            first, chunk = chunks.pop()
            chunks.append((first, chunk[:start - first]))
        chunks.append((start, rows))

    def take(self, lo: int, hi: int, width: int) -> torch.Tensor:
        """[hi - lo, width] states of positions [lo, hi) (zeros where none was seen); those before hi dropped."""
        out = torch.zeros(hi - lo, width, dtype=self.chunks[0][1].dtype if self.chunks else torch.float32)
        rest = []
        for first, chunk in self.chunks:
            a, b = max(lo, first), min(hi, first + chunk.shape[0])
            if a < b:
                out[a - lo:b - lo] = chunk[a - first:b - first]
            if first + chunk.shape[0] > hi:
                rest.append((max(first, hi), chunk[max(hi - first, 0):]))
        self.chunks = rest
        return out


class Eagle3Proposer:
    def __init__(self, model: str | None, target_dir, target_config, max_batch_size: int, target_blocks: int):
        build = target_config.build_config
        if build.speculative_decoding_mode != "eagle3":
            raise ConfigError(f"engine {target_dir} was not built for EAGLE-3 (it does not return the target's hidden "
                              f"states): convert the model with convert_checkpoint --eagle_model_dir DRAFT and "
                              f"rebuild it")
        bundled = Path(target_dir) / DRAFT_DIR
        self.draft = Eagle3Draft.load(Path(model) if model else bundled, target_config.pretrained_config,
                                      build.hidden_state_layers, bundled)
        tpb = build.tokens_per_block
        # As many tokens as the target's pool holds, and a block per sequence for drafts past its last
        blocks_per_seq = build.max_blocks_per_seq + 1
        self.kv = KVCacheManager(target_blocks + max_batch_size, tpb, max_batch_size, blocks_per_seq,
                                 enable_prefix_caching=False)
        self.kv_cache = self.draft.kv_pool(self.kv.pool.num_blocks, tpb)
        self.followers: dict[int, _Follower] = {}

    def observe(self, scheduled: list[tuple[Sequence, int]], captured: torch.Tensor) -> None:
        """A target step's captured states, [T, 3 * hidden] in the step's token order (kept as they
        are, fused by `fc` only when the draft reads them); called before the step's tokens count as
        computed."""
        row = 0
        for seq, n in scheduled:
            self._follower(seq).put(seq.num_computed_tokens, captured[row:row + n])
            row += n

    def _follower(self, seq: Sequence) -> _Follower:
        f = self.followers.get(seq)  # keyed by the sequence itself: its id is not reused while it is here
        if f is None:
            f = self.followers[seq] = _Follower(seq)
        return f

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        drafts = [[] for _ in seqs]
        live, out, hidden = [], SchedulerOutput(), []
        width = 3 * self.draft.shape.target_hidden_size
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            f = self._follower(seq)
            d, C = f.draft, seq.num_computed_tokens
            M = min(d.num_computed_tokens, C)
            d.token_ids, d.num_computed_tokens = list(seq.token_ids[1:C + 1]), M
            n = C - M
            if n <= 0 or not self.kv.allocate_slots(d, n + k):
                continue  # no room: the target decodes it plainly this step
            out.scheduled.append((d, n))
            hidden.append(f.take(M, C, width))
            live.append((i, k))
        hidden = self.draft.fuse(torch.cat(hidden)) if hidden else None
        while out.scheduled:
            plan = plan_step(out, self.kv.tokens_per_block, self.kv.block_tables)
            tokens, prenorm = self.draft(plan.inputs, hidden, self.kv_cache)
            nxt, rows = SchedulerOutput(), []
            for j, ((d, n), (i, k)) in enumerate(zip(out.scheduled, live)):
                d.num_computed_tokens += n
                token = int(tokens[j])
                d.token_ids.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < k:
                    nxt.scheduled.append((d, 1))
                    rows.append(j)
            live = [(i, k) for i, k in live if len(drafts[i]) < k]
            out, hidden = nxt, prenorm[rows]
        for seq in seqs:  # the draft's own positions are rewritten from the target's states next time
            f = self.followers[seq]
            C = seq.num_computed_tokens
            f.draft.num_computed_tokens = min(f.draft.num_computed_tokens, C)
            del f.draft.token_ids[C:]
        return drafts

    def prune(self, live: set[int]) -> None:
        """Drop the state of target sequences that no longer run (finished, preempted)."""
        for key in [k for k in self.followers if id(k) not in live]:
            self.kv.free(self.followers.pop(key).draft)
