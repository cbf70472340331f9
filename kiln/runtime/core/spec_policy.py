"""How many tokens each decoding sequence drafts in a step.

A fixed num_speculative_tokens drafts that many (as its limits allow). "auto" picks k per request,
0 included, each step, to maximize the tokens the step is expected to emit per second:

- a request's draft j is accepted with probability a_j, the request's running acceptance at position
  j given the one before was accepted, pulled towards the engine's rate at that position while it has
  few verifications of its own; k drafts emit 1 + a_1 + a_1 a_2 + ... tokens in expectation;
- a step costs `StepCost.seconds`: its plain tokens' cost, measured when the engine starts (T = 1,
  2, 4, ... tokens in one step) and kept up to date from the plain steps it runs, plus what each
  draft token verified has cost in the speculating steps it ran; drafting costs the proposer's
  measured seconds per drafting pass.

Adding drafts in order of their expected gain, the policy keeps the count that maximizes expected
tokens / expected seconds, which is 0 drafts (the plain step) whenever no draft pays for itself:
under load, verifying more tokens costs more than the drafts are expected to save.
"""
from __future__ import annotations

import bisect
import time

from kiln.runtime.messages import SpecStats

PRIOR_WEIGHT = 4.0  # verifications of its own before a request's rate counts as much as the engine's
EMA = 0.2  # weight of a new timing
RECHECK_STEPS = 15  # steps the requests of a batch whose drafts did not pay run plainly before they are weighed again


class Curve:
    """Seconds by a count (tokens, sequences), interpolated between the counts measured."""

    def __init__(self):
        self.points: dict[int, float] = {}
        self.xs: list[int] = []

    def record(self, x: int, seconds: float) -> None:
        old = self.points.get(x)
        if old is None:
            bisect.insort(self.xs, x)
        self.points[x] = seconds if old is None else (1 - EMA) * old + EMA * seconds

    def __call__(self, x: int) -> float:
        xs, points = self.xs, self.points
        if not xs:
            return 0.0
        if x in points:
            return points[x]
        i = bisect.bisect_left(xs, x)
        if i == 0:
            return points[xs[0]]
        if i == len(xs):  # past the largest measured: linear from the two largest
            if len(xs) == 1:
                return points[xs[-1]] * x / xs[-1]
            x0, x1 = xs[-2], xs[-1]
        else:
            x0, x1 = xs[i - 1], xs[i]
        return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


class StepCost:
    """Seconds of a step: `plain` by its tokens (measured at start, then from the steps run without
    drafts), plus, per draft token verified, what the speculating steps run have cost beyond the
    plain step of their other tokens (verification and its context-phase attention included), by
    the size of that plain step (powers of two); until then, the plain curve's slope."""

    def __init__(self):
        self.plain = Curve()
        self.per_draft: dict[int, float] = {}

    @staticmethod
    def _bucket(tokens: int) -> int:
        return 1 << max(tokens - 1, 0).bit_length()

    def record(self, tokens: int, seconds: float, drafts: int = 0) -> None:
        if not drafts:
            self.plain.record(tokens, seconds)
            return
        base = tokens - drafts
        sample = max(seconds - self.plain(base), 0.0) / drafts
        key = self._bucket(base)
        old = self.per_draft.get(key)
        self.per_draft[key] = sample if old is None else (1 - EMA) * old + EMA * sample

    def seconds(self, tokens: int, drafts: int = 0) -> float:
        if not drafts:
            return self.plain(tokens)
        per = self.per_draft.get(self._bucket(tokens))
        if per is None:
            per = max(self.plain(tokens + drafts) - self.plain(tokens), 0.0) / drafts
        return self.plain(tokens) + drafts * per


class Acceptance:
    """Per-position acceptance: the engine's, and each request's own (on the request, in spec_counts)."""

    def __init__(self, stats: SpecStats, max_draft: int):
        self.stats, self.tried = stats, [0] * max_draft

    def record(self, req, num_drafted: int, num_accepted: int) -> None:
        counts = req.spec_counts
        if counts is None:
            counts = req.spec_counts = [[0] * len(self.tried), [0] * len(self.tried)]
        for j in range(min(num_accepted + 1, num_drafted)):  # positions tried: up to the first rejection
            self.tried[j] += 1
            counts[1][j] += 1
            counts[0][j] += j < num_accepted

    def engine_rates(self) -> list[float]:
        return [(accepted + 1) / (tried + 2) for accepted, tried in zip(self.stats.accepted_per_pos, self.tried)]

    def rates(self, req, engine: list[float] | None = None) -> list[float]:
        """a_j: P(draft j accepted | draft j - 1 accepted); engine: engine_rates(), if at hand."""
        engine = engine or self.engine_rates()
        if req.spec_counts is None:
            return engine
        accepted, tried = req.spec_counts
        return [(a + PRIOR_WEIGHT * e) / (n + PRIOR_WEIGHT) for a, n, e in zip(accepted, tried, engine)]


class DraftPolicy:
    def __init__(self, auto: bool, max_draft: int, stats: SpecStats):
        self.auto, self.max_draft = auto, max_draft
        self.step_cost = StepCost()
        self.draft_cost = Curve()  # seconds per drafting pass, by the sequences drafting
        self.acceptance = Acceptance(stats, max_draft)
        self.idle, self.idle_batch = 0, ()

    def choose(self, reqs: list, limits: list[int], other_tokens: int) -> list[int]:
        """Drafts per sequence (each at most its limit); other_tokens: what else the step computes."""
        if not self.auto:
            return [min(self.max_draft, lim) for lim in limits]
        batch = tuple(map(id, reqs))
        if self.idle > 0 and batch == self.idle_batch:  # nothing paid a moment ago for these requests
            self.idle -= 1
            return [0] * len(reqs)
        engine = self.acceptance.engine_rates()
        gains = []  # (expected tokens it adds, sequence)
        for i, (req, lim) in enumerate(zip(reqs, limits)):
            p = 1.0
            for a in self.acceptance.rates(req, engine)[:lim]:
                p *= a
                gains.append((p, i))
        gains.sort(key=lambda g: -g[0])
        base = len(reqs) + other_tokens
        best_rate, best_n = len(reqs) / max(self.step_cost.seconds(base), 1e-9), 0
        expected, depth, drafting, deepest = float(len(reqs)), [0] * len(reqs), 0, 0
        for n, (gain, i) in enumerate(gains, 1):
            drafting += depth[i] == 0
            depth[i] += 1
            deepest = max(deepest, depth[i])
            expected += gain
            seconds = max(self.step_cost.seconds(base, n) + deepest * self.draft_cost(drafting), 1e-9)
            if expected / seconds > best_rate:
                best_rate, best_n = expected / seconds, n
        ks = [0] * len(reqs)
        for _, i in gains[:best_n]:
            ks[i] += 1
        # Deciding costs Python time per sequence each step: with nothing to draft, the same requests are
        # not weighed again for a few steps (the plain step's speed, less a sixteenth of a decision).
        self.idle, self.idle_batch = (RECHECK_STEPS, batch) if not best_n else (0, ())
        return ks

    def timed_propose(self, propose, seqs: list, ks: list[int]) -> list[list[int]]:
        start = time.perf_counter()
        drafts = propose(seqs, ks)
        if seqs and max(ks):
            self.draft_cost.record(len(seqs), (time.perf_counter() - start) / max(ks))
        return drafts
