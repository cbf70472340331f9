"""Speculative decoding: cheap proposals for a sequence's next tokens, verified by the target model
in one step (DESIGN.md: a speculating sequence is 1 + k query tokens through the context phase).

`SpecDecoder` is all the engine core sees of it: `propose` before a step is scheduled (each
decoding sequence's `draft_token_ids`), `verify` after (the tokens each one emits, with the
counters kept).

Proposers: `NgramProposer` (prompt lookup: the tokens that followed the latest earlier occurrence
of the sequence's last n-gram) and `DraftProposer` (a second, smaller Kiln engine with its own KV
cache, decoding greedily). Both propose deterministic tokens, so the draft distribution q is
one-hot and speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023) reduces to:
accept draft token d with probability p(d) under the target's processed distribution p
(temperature, top-k/p, min-p, penalties, min_tokens: exactly what the sampler draws from);
on the first rejection draw from p with d removed, renormalized; when every draft is accepted,
draw a bonus token from p at the last position. The emitted tokens are distributed exactly as
plain sampling's. Greedy rows accept while the target's argmax agrees.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.config import ConfigError, EngineConfig
from kiln.runtime.core.eagle3_proposer import Eagle3Proposer
from kiln.runtime.core.kv_cache_manager import KVCacheManager
from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.core.sample.rows import SampleRow, apply_allowed, call_key, draw_stream, draw_uniform, logprob_dicts
from kiln.runtime.core.sample.torch_sampler import TorchSampler
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.core.spec_policy import DraftPolicy
from kiln.runtime.core.step_plan import plan_step
from kiln.runtime.executor.uniproc import UniprocExecutor
from kiln.runtime.messages import SpecStats
from kiln.runtime.sampling_params import SamplingParams

METHODS = ("ngram", "draft_model", "eagle3")
ACCEPT_ROUND, RESIDUAL_ROUND = 1, 2  # draws of a verification, apart from the sampler's own (round 0)
# TensorRT-LLM's LLM-API names (its decoding configs' decoding_type, max_draft_len, speculative_model_dir)
DECODING_TYPES = {"NGram": "ngram", "DraftTarget": "draft_model", "Eagle3": "eagle3"}
TRTLLM_KEYS = {"decoding_type": "method", "max_draft_len": "num_speculative_tokens",
               "speculative_model_dir": "model", "speculative_model": "model",
               "max_matching_ngram_size": "prompt_lookup_max"}
AUTO = "auto"
AUTO_MAX_DRAFT = 4  # the most tokens "auto" drafts for one request in one step


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config (method, model, num_speculative_tokens, prompt_lookup_max/min), and
    draft_engine_dir for a draft engine; num_speculative_tokens "auto" (the default): each step picks
    0..AUTO_MAX_DRAFT per request (spec_policy.py)."""
    method: str
    num_speculative_tokens: int | str = AUTO
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_engine_dir: str | None = None
    model: str | None = None
    draft_tensor_parallel_size: int = 1  # vLLM's; an EAGLE-3 draft (one layer) runs whole, whatever the target's TP

    @property
    def auto(self) -> bool:
        return self.num_speculative_tokens == AUTO

    @property
    def max_draft(self) -> int:
        return AUTO_MAX_DRAFT if self.auto else self.num_speculative_tokens

    @classmethod
    def from_dict(cls, d: dict | None) -> SpeculativeConfig | None:
        if d is None:
            return None
        if not isinstance(d, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(d).__name__}")
        d = _vllm_names(d)
        keys = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "draft_engine_dir",
                "model", "draft_tensor_parallel_size")
        unknown = set(d) - set(keys)
        if unknown:
            raise ConfigError(f"speculative_config has unknown key(s) {', '.join(sorted(unknown))}; expected "
                              f"{', '.join(keys)} (or TensorRT-LLM's {', '.join(TRTLLM_KEYS)})")
        if d.get("method") not in METHODS:
            raise ConfigError(f"speculative_config method {d.get('method')!r} is not supported; expected "
                              f"one of {', '.join(METHODS)}")
        c = cls(**d)
        k = c.num_speculative_tokens
        if k != AUTO and (not isinstance(k, int) or isinstance(k, bool) or k < 1):
            raise ConfigError(f"speculative_config num_speculative_tokens must be an int >= 1 or \"auto\", got {k!r}")
        if c.method == "ngram" and not 1 <= c.prompt_lookup_min <= c.prompt_lookup_max:
            raise ConfigError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{c.prompt_lookup_min} and {c.prompt_lookup_max}")
        if c.method == "draft_model" and not c.draft_engine_dir:
            raise ConfigError("speculative_config method draft_model needs draft_engine_dir")
        if c.model is not None and c.method != "eagle3":
            raise ConfigError(f"speculative_config model is read for method eagle3 (the EAGLE-3 draft's dir); for "
                              f"{c.method} {'use draft_engine_dir' if c.method == 'draft_model' else 'leave it out'}")
        return c


def _vllm_names(d: dict) -> dict:
    """TensorRT-LLM's LLM-API names (Eagle3DecodingConfig(max_draft_len=3, speculative_model_dir=...)) as vLLM's."""
    out = {}
    for key, value in d.items():
        name = TRTLLM_KEYS.get(key, key)
        if key == "decoding_type":
            if value not in DECODING_TYPES:
                raise ConfigError(f"speculative_config decoding_type {value!r} is not supported; expected one of "
                                  f"{', '.join(DECODING_TYPES)}")
            value = DECODING_TYPES[value]
        if name in out and out[name] != value:
            raise ConfigError(f"speculative_config gives {name} twice, as {key} and as {name}: use one")
        out[name] = value
    return out


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.max_n, self.min_n = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        return [self._lookup(seq.token_ids, k) for seq, k in zip(seqs, ks)]

    def _lookup(self, token_ids: list[int], k: int) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest suffix n-gram that is
        followed by k tokens (else after the latest one, however few follow it)."""
        data = array("i", token_ids).tobytes()
        for n in range(min(self.max_n, len(token_ids) - 1), self.min_n - 1, -1):
            suffix = data[-4 * n:]
            for end in (len(data) - 4 * k, len(data) - 4):  # where the occurrence must end by
                start = _rfind_aligned(data, suffix, end)
                if start >= 0:
                    return token_ids[start + n:start + n + k]
        return []

    def prune(self, live: set[int]) -> None:
        pass


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int:
    """The token index of the latest occurrence of pattern (4-byte tokens) ending by byte `end`."""
    while end >= len(pattern):
        pos = data.rfind(pattern, 0, end)
        if pos < 0:
            return -1
        if pos % 4 == 0:  # bytes.rfind also matches across token boundaries
            return pos // 4
        end = pos + len(pattern) - 1
    return -1


class DraftProposer:
    """A smaller engine proposes by greedy decoding. Its KV cache follows each target sequence: the
    tokens it has computed stay valid as long as they agree with the target's tokens."""

    def __init__(self, config: SpeculativeConfig, target_dir, target_config, max_batch_size: int):
        draft_dir = Path(config.draft_engine_dir)
        draft = EngineConfig.load(draft_dir)
        tp, db = target_config.pretrained_config, draft.build_config
        _check_compatible(draft_dir, draft, Path(target_dir), target_config)
        self.executor = UniprocExecutor(draft_dir)
        self.kv = KVCacheManager(self.executor.num_blocks, db.tokens_per_block, max_batch_size,
                                 db.max_blocks_per_seq, enable_prefix_caching=False)
        self.max_num_tokens = db.max_num_tokens
        # A LongRoPE draft is not recomputed past its threshold: its proposals may get worse, never the output
        self.sequence_lens = bool(draft.pretrained_config.long_rope_threshold)
        self.seqs: dict[int, object] = {}  # id(target sequence) -> its draft sequence
        self.vocab_size = tp.vocab_size

    def propose(self, seqs: list, ks: list[int]) -> list[list[int]]:
        drafts = [[] for _ in seqs]
        live = []  # (position in seqs, draft sequence, tokens to propose)
        out, budget = SchedulerOutput(), self.max_num_tokens
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            d = self._follow(seq)
            n = d.num_tokens - d.num_computed_tokens
            if n > budget or not self.kv.allocate_slots(d, n + k):
                continue  # no room this step: the target decodes it plainly
            budget -= n
            out.scheduled.append((d, n))
            live.append((i, d, k))
        for _ in range(max((k for *_, k in live), default=0)):
            if not out.scheduled:
                break
            plan = plan_step(out, self.kv.tokens_per_block, self.kv.block_tables, self.sequence_lens)
            logits = self.executor.execute(plan.inputs)
            tokens = logits[[row for _, row in plan.sample]].argmax(-1).tolist()
            nxt = SchedulerOutput()
            for (d, n), (i, _, k), token in zip(out.scheduled, live, tokens):
                d.num_computed_tokens += n
                d.token_ids.append(token)
                drafts[i].append(token)
                if len(drafts[i]) < k:
                    nxt.scheduled.append((d, 1))
            live = [entry for entry in live if len(drafts[entry[0]]) < entry[2]]
            out = nxt
        return drafts

    def _follow(self, seq):
        """The draft sequence of a target sequence, its tokens made the target's, keeping the K/V
        of the prefix the two agree on."""
        d = self.seqs.get(id(seq))
        if d is None:
            req = Request("draft", seq.request.prompt_token_ids, SamplingParams(), seq.request.max_tokens)
            d = self.seqs[id(seq)] = Sequence(req, 0, [])
        target = seq.token_ids
        agree = 0
        limit = min(d.num_computed_tokens, len(target))
        while agree < limit and d.token_ids[agree] == target[agree]:
            agree += 1
        d.token_ids = list(target)
        d.num_computed_tokens = agree
        return d

    def prune(self, live: set[int]) -> None:
        """Drop the draft state of target sequences that no longer run (finished, preempted)."""
        for key in [k for k in self.seqs if k not in live]:
            self.kv.free(self.seqs.pop(key))


def _check_compatible(draft_dir: Path, draft, target_dir: Path, target) -> None:
    tp, dp = target.pretrained_config, draft.pretrained_config
    if dp.vocab_size != tp.vocab_size:
        raise ConfigError(f"draft engine {draft_dir} has vocab_size {dp.vocab_size}, the target {tp.vocab_size}: "
                          f"speculation needs the same tokenizer")
    for name in ("tokenizer.json", "tokenizer.model"):
        a, b = draft_dir / name, target_dir / name
        if a.is_file() and b.is_file() and a.read_bytes() != b.read_bytes():
            raise ConfigError(f"draft engine {draft_dir} has another {name} than the target engine "
                              f"{target_dir}: speculation needs the same tokenizer")
    if draft.build_config.max_seq_len < target.build_config.max_seq_len:
        raise ConfigError(f"draft engine {draft_dir} has max_seq_len {draft.build_config.max_seq_len}, below the "
                          f"target's {target.build_config.max_seq_len}")


def target_probs(sampler, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """[R, V] the distribution the sampler draws each row's token from: min_tokens masking and the
    penalties, then one-hot argmax (greedy rows) or temperature, top-k, top-p, min-p, softmax."""
    x = sampler.process_logits(logits, rows)
    probs = torch.zeros_like(x)
    for i, r in enumerate(rows):
        if r.params.greedy:
            probs[i, x[i].argmax()] = 1.0
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        s = TorchSampler.truncate(x[sampled], [rows[i].params for i in sampled])
        probs[sampled] = s.softmax(-1)
    return probs


@dataclass
class Verified:
    token_ids: list[int]  # the accepted drafts, then a corrected or bonus token
    logprobs: list[dict[int, float]] | None
    num_accepted: int


def verify(sampler, logits: torch.Tensor, rows: list[SampleRow], drafts: list[list[int]],
           allowed: list[list[torch.Tensor] | None] | None = None) -> list[Verified]:
    """Each sequence's drafts against its len(drafts) + 1 logits rows (consecutive in `logits`, in
    order); `rows` holds one SampleRow per sequence, as of before the step; `allowed`, per sequence,
    a guided one's grammar bitmask at each position (None: unguided)."""
    position_rows, starts = [], []
    for i, (row, d) in enumerate(zip(rows, drafts)):
        starts.append(len(position_rows))
        masks = (allowed[i] if allowed else None) or [None] * (len(d) + 1)
        for j in range(len(d) + 1):  # position j sees the drafts before it as output
            position_rows.append(SampleRow(row.params, row.prompt_token_ids, list(row.output_token_ids) + d[:j],
                                           row.generator, row.eos_token_ids, masks[j]))
    logits = apply_allowed(logits, position_rows)
    probs = target_probs(sampler, logits, position_rows)
    key = call_key(rows)
    results = []
    for i, (row, d, start) in enumerate(zip(rows, drafts, starts)):
        seed, stream = draw_stream(row, i, key)
        emitted, done = [], False
        for j in range(len(d) + 1):
            p, t = probs[start + j], len(row.output_token_ids) + j
            if row.params.greedy:
                token = int(p.argmax())
            elif j < len(d) and draw_uniform(seed, stream, t, ACCEPT_ROUND) < float(p[d[j]]):
                token = d[j]
            else:
                if j < len(d):  # rejected: the residual max(p - q, 0) with q one-hot at the draft
                    p = p.clone()
                    p[d[j]] = 0
                cdf = p.double().cumsum(0)
                u = draw_uniform(seed, stream, t, RESIDUAL_ROUND) * float(cdf[-1])
                token = min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=torch.float64), right=True)),
                            p.shape[0] - 1)
            emitted.append(token)
            if j == len(d) or token != d[j]:
                done = True
            if done:
                break
        lps = None
        if row.params.logprobs is not None:
            lp = torch.log_softmax(logits[start:start + len(emitted)].float(), -1)
            lps, _ = logprob_dicts(lp, torch.tensor(emitted), [row.params.logprobs] * len(emitted), False)
        results.append(Verified(emitted, lps, len(emitted) - 1))
    return results


class SpecDecoder:
    """Drafts for the decoding sequences before a step, and their verification after it. A sequence
    drafts as many tokens as the policy gives it (spec_policy.py), none past its max_tokens (the last
    token is the target's own) or the engine's max_seq_len."""

    def __init__(self, config: SpeculativeConfig, target_dir, target_config, max_batch_size: int,
                 target_blocks: int = 0):
        if config.method == "ngram":
            self.proposer = NgramProposer(config)
        elif config.method == "eagle3":
            self.proposer = Eagle3Proposer(config.model, target_dir, target_config, max_batch_size, target_blocks)
        else:
            self.proposer = DraftProposer(config, target_dir, target_config, max_batch_size)
        self.config = config
        self.max_seq_len = target_config.build_config.max_seq_len
        self.stats = SpecStats(accepted_per_pos=[0] * config.max_draft)
        self.policy = DraftPolicy(config.auto, config.max_draft, self.stats)

    @classmethod
    def create(cls, speculative_config: dict | None, target_dir, target_config,
               max_batch_size: int, target_blocks: int = 0) -> SpecDecoder | None:
        config = SpeculativeConfig.from_dict(speculative_config)
        return None if config is None else cls(config, target_dir, target_config, max_batch_size, target_blocks)

    def prune(self, running: list[Sequence]) -> None:
        """After a step: the proposer drops what it holds for sequences no longer running (finished, preempted)."""
        self.proposer.prune({id(s) for s in running})

    def observe(self, scheduled: list, captured: torch.Tensor | None) -> None:
        """A step's captured target hidden states, for a proposer that reads them (EAGLE-3)."""
        if captured is not None and hasattr(self.proposer, "observe"):
            self.proposer.observe(scheduled, captured)

    def propose(self, running: list[Sequence]) -> None:
        seqs, limits, other = [], [], 0
        for seq in running:
            seq.draft_token_ids = []
            req = seq.request
            if req.forked and not seq.prefilling and not req.params.use_beam_search:  # beams reorder: nothing to follow
                limit = min(req.max_tokens - seq.num_output_tokens - 1, self.max_seq_len - seq.num_tokens)
                if limit > 0:
                    seqs.append(seq)
                    limits.append(limit)
                    continue
            other += 1 if not seq.prefilling else seq.num_tokens - seq.num_computed_tokens
        ks = self.policy.choose([s.request for s in seqs], limits, other)
        drafting = [(s, k) for s, k in zip(seqs, ks) if k > 0]
        if not drafting:
            return
        seqs, ks = zip(*drafting)
        for seq, drafts in zip(seqs, self.policy.timed_propose(self.proposer.propose, list(seqs), list(ks))):
            seq.draft_token_ids = drafts

    def verify(self, sampler, logits: torch.Tensor, to_verify: list[tuple[Sequence, list[int]]],
               allowed: dict | None = None) -> list[Verified]:
        """What each sequence emits: its drafts against its logits rows (the last token's, then each
        draft's); its drafts are cleared and the request's and the engine's counters kept. allowed:
        the guided sequences' bitmask rows per position (structured_output.py)."""
        seqs = [seq for seq, _ in to_verify]
        drafts = [seq.draft_token_ids for seq in seqs]
        results = verify(sampler, logits[[r for _, rs in to_verify for r in rs]], [
            SampleRow(s.request.params, s.request.prompt_token_ids, s.output_token_ids, s.generator,
                      s.request.eos_token_ids) for s in seqs], drafts, [(allowed or {}).get(s) for s in seqs])
        stats = self.stats
        for seq, d, res in zip(seqs, drafts, results):
            seq.draft_token_ids = []
            req = seq.request
            req.num_draft_tokens += len(d)
            req.num_accepted_tokens += res.num_accepted
            self.policy.acceptance.record(req, len(d), res.num_accepted)
            stats.num_drafts += 1
            stats.num_draft_tokens += len(d)
            stats.num_accepted_tokens += res.num_accepted
            for pos in range(res.num_accepted):
                stats.accepted_per_pos[pos] += 1
        return results
