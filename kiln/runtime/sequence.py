"""A request and its sequences (n > 1 samples fork from one prefilled prompt)."""
import enum
import time
from dataclasses import dataclass, field

import torch

from kiln.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: "Request"
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + generated
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    reserved_blocks: int = 0  # guaranteed_no_evict: blocks promised but not yet taken
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    detokenizer: object = None  # kiln.runtime.detokenizer.IncrementalDetokenizer
    generation_logits: list[torch.Tensor] | None = None  # return_generation_logits: one row per output token

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.request.num_prompt_tokens

    @property
    def prefilling(self) -> bool:
        """Still computing the prompt (or recomputing prompt + output after a preemption)."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens bounded by the engine's max_seq_len
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    context_logits: torch.Tensor | None = None  # return_context_logits: the prompt positions computed so far
    forked: bool = False  # the n samples exist (after the prompt's last chunk)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_len(self) -> int:
        """Prompt + the most tokens a sample may generate (max_tokens is already bounded by max_seq_len)."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.sequences)
