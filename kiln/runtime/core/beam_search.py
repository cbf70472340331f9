"""Beam search: one request's beams, and the choice of the next ones each step.

A beam search request's sequences are its beams (kiln/runtime/core/request.py). Each step every
running beam's next-token log-probabilities are added to its running score; of all beams'
continuations the best `keep` (2 x width, more with several stop tokens) are ranked. The best
`width` of those that do not end (on a stop token or the length limit) are the next running
beams; those among the top `width` that end become finished hypotheses, scored by the length
penalty, of which the best `width` are kept. The search stops as Hugging Face's `generate` does:
`early_stopping=True` once `width` hypotheses are finished; `False` once the best running beam,
scored at its current length, cannot beat the worst of them; `"never"` the same, scored at
max_tokens when the length penalty favours long outputs; and always when every continuation ends.

`BeamSearch` is the request-group policy (request_group.py): it keeps each beam's log-probabilities
as the core draws them, calls `BeamGroup.step` once every running beam has them (a preempted beam is
recomputed first), moves the beams' KV blocks to their new parents (kv_cache_manager.py `reassign`),
and gives the best n hypotheses when the search is done: beams reorder, so nothing streams before.
"""
import time
from dataclasses import dataclass, field

import torch

from kiln.runtime.core.request import Sequence
from kiln.runtime.core.request_group import RequestGroup, Settled
from kiln.runtime.messages import SampleDelta
from kiln.runtime.sampling_params import SAMPLING_EPS, SamplingParams


@dataclass
class Hypothesis:
    token_ids: list[int]  # the output tokens
    logprobs: list[float]  # of each
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (a stop token ended it) or "length"
    stop_reason: int | None = None  # the stop token id (not EOS) that ended it


@dataclass
class Continuation:
    parent: int  # index of the running beam it extends
    token: int
    logprob: float
    cumulative_logprob: float


@dataclass
class BeamGroup:
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # Hugging Face's early-stop heuristic, sticky once False
    done: bool = False

    def __post_init__(self):
        p = self.params
        self.width = p.beam_width
        self.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else frozenset(self.eos_token_ids))
        self.keep = max(2, 1 + len(self.stop_ids)) * self.width

    def step(self, logprobs: torch.Tensor, scores: list[float], outputs: list[list[int]],
             histories: list[list[float]]) -> list[Continuation]:
        """logprobs: [beams, vocab] float32, the running beams' next-token log-probabilities; scores,
        outputs and histories: their running scores, output tokens and those tokens' log-probabilities
        (all the same length). Returns the next running beams, best first (none once done)."""
        vocab = logprobs.shape[1]
        length = len(outputs[0]) + 1  # of every continuation
        if length <= self.params.min_tokens and len(self.stop_ids):
            logprobs = logprobs.clone()
            logprobs[:, sorted(self.stop_ids)] = float("-inf")
        total = (logprobs + torch.tensor(scores, dtype=torch.float32)[:, None]).flatten()
        top, index = total.topk(min(self.keep, total.numel()))
        beam_index, token_index = index // vocab, index % vocab
        beams, tokens, own = beam_index.tolist(), token_index.tolist(), logprobs[beam_index, token_index].tolist()
        ends = [length >= self.max_tokens or t in self.stop_ids for t in tokens]

        lp, full = self.params.length_penalty, len(self.finished) == self.width
        if self.improvable and not (full and self.params.early_stopping is True):
            penalized = (top[:self.width] / (length ** lp)).tolist()
            for rank in range(min(self.width, len(tokens))):
                if ends[rank]:
                    t = tokens[rank]
                    stop = t in self.stop_ids
                    b = beams[rank]
                    self.finished.append(Hypothesis(
                        outputs[b] + [t], histories[b] + [own[rank]], float(top[rank]), penalized[rank],
                        "stop" if stop else "length", t if stop and t in self.params.stop_token_ids else None))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[self.width:]

        running = [Continuation(b, t, lp, s) for b, t, lp, s, e in zip(beams, tokens, own, top.tolist(), ends) if not e]
        running = running[:self.width]
        if all(ends):
            self.done = True
            return []
        if len(self.finished) == self.width:
            best_length = self.max_tokens if self.params.early_stopping == "never" and lp > 0 else length
            best = float(torch.tensor(running[0].cumulative_logprob, dtype=torch.float32) / (best_length ** lp))
            self.improvable = self.improvable and best > self.finished[-1].score
            self.done = not self.improvable or self.params.early_stopping is True
        return [] if self.done else running

    def results(self) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return self.finished[:self.params.n]


@dataclass
class Beam:
    """A running beam's score, its output tokens' log-probabilities, and its next-token
    log-probabilities once its last token is computed."""
    score: float = 0.0
    history: list[float] = field(default_factory=list)
    logprobs: torch.Tensor | None = None


class BeamSearch(RequestGroup):
    def __init__(self, request, host):
        super().__init__(request, host)
        self.search = BeamGroup(request.params, request.max_tokens, request.eos_token_ids)
        self.beams: dict[Sequence, Beam] = {}
        self.drawn = False

    def draw(self, seq: Sequence, logits: torch.Tensor, row: int) -> list[Sequence]:
        self.beams.setdefault(seq, Beam()).logprobs = _beam_logprobs(logits[row], self.request.params.temperature)
        self.drawn = True
        return []

    def settle(self) -> Settled | None:
        if not self.drawn:
            return None
        self.drawn = False
        req, host = self.request, self.host
        running = [s for s in req.sequences if not s.finished]
        state = [self.beams.setdefault(b, Beam()) for b in running]
        if not all(s.logprobs is not None and b.num_computed_tokens == b.num_tokens for b, s in zip(running, state)):
            return None  # some are being recomputed after a preemption
        outputs = [b.output_token_ids for b in running]
        chosen = self.search.step(torch.stack([s.logprobs for s in state]), [s.score for s in state], outputs,
                                  [s.history for s in state])
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if self.search.done:
            return Settled(results=self._finish(running))
        new = [host.new_sequence(req, i, []) for i in range(len(running), len(chosen))]
        host.kv.split_reservation(running[0], new)
        running += new
        copies = host.kv.reassign(running, [c.parent for c in chosen])
        self.beams = {b: Beam(c.cumulative_logprob, state[c.parent].history + [c.logprob])
                      for b, c in zip(running, chosen)}
        for b, c in zip(running, chosen):
            b.token_ids = req.prompt_token_ids + outputs[c.parent] + [c.token]
        if new:
            req.sequences.extend(new)
            host.scheduler.add_forked(new)
            req.forked = True
        return Settled(copies)

    def _finish(self, beams: list[Sequence]) -> list[SampleDelta]:
        req = self.request
        for b in beams:
            b.finish_reason = "stop"
            self.host.scheduler.finish(b)
        req.forked = True
        want_lp = req.params.logprobs is not None
        return [SampleDelta(i, h.token_ids, [{t: lp} for t, lp in zip(h.token_ids, h.logprobs)] if want_lp else None,
                            h.finish_reason, h.stop_reason, cumulative_logprob=h.cumulative_logprob)
                for i, h in enumerate(self.search.results())]


def _beam_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    if temperature > SAMPLING_EPS and temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1)
