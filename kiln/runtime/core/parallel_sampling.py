"""n > 1 samples of one prompt: the prompt is computed once, then its sequence forks into n that
share its KV blocks (a partly filled last block copied for all but one), each drawing its first
token from the same logits row."""
import torch

from kiln.runtime.core.request import Sequence
from kiln.runtime.core.request_group import RequestGroup, Settled


class ParallelSampling(RequestGroup):
    def __init__(self, request, host):
        super().__init__(request, host)
        self.copies: list[tuple[int, int]] = []

    def draw(self, seq: Sequence, logits: torch.Tensor, row: int) -> list[Sequence]:
        if not self.request.forked:
            self._fork(seq)
            return list(self.request.sequences)
        return [seq]

    def settle(self) -> Settled | None:
        copies, self.copies = self.copies, []
        return Settled(copies) if copies else None

    def _fork(self, parent: Sequence) -> None:
        req, host = self.request, self.host
        children = [host.new_sequence(req, index, list(parent.token_ids)) for index in range(1, req.params.n)]
        host.kv.split_reservation(parent, children)
        for child in children:
            child.num_computed_tokens = parent.num_computed_tokens
            if parent.matcher is not None:
                child.matcher = host.structured.matcher(req)
            pair = host.kv.fork(parent, child)
            if pair:
                self.copies.append(pair)
        req.sequences.extend(children)
        host.scheduler.add_forked(children)
        req.forked = True
