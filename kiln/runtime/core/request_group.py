"""How a request's sequences come to be and advance: a policy per request, behind two calls the
engine core makes, as speculation sits behind `propose` and `verify`.

- `draw(seq, logits, row)`: the sequences the sampler draws a token for from a scheduled sequence's
  logits row: the sequence itself; the n samples of a parallel-sampling request once its prompt is
  computed (parallel_sampling.py); none for a beam, whose log-probabilities its search keeps
  (beam_search.py).
- `settle()`, once after the step's sampling: KV block copies the group's new sequences need, and,
  for a search that ended, its results.

Groups use the core as their host: `host.new_sequence`, `host.kv` (the KV cache manager),
`host.scheduler` and `host.structured` (guided decoding's matchers).
"""
from dataclasses import dataclass, field

import torch

from kiln.runtime.core.request import Request, Sequence
from kiln.runtime.messages import SampleDelta


@dataclass
class Settled:
    copies: list[tuple[int, int]] = field(default_factory=list)  # (source block, destination block)
    results: list[SampleDelta] | None = None  # a finished search's samples, sent whole


class RequestGroup:
    """One sequence, sampled as it is scheduled."""

    def __init__(self, request: Request, host):
        self.request, self.host = request, host

    def draw(self, seq: Sequence, logits: torch.Tensor, row: int) -> list[Sequence]:
        return [seq]

    def settle(self) -> Settled | None:
        return None

