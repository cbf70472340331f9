"""What generation returns, with vLLM's names so that users' code carries over."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # return_generation_logits: the raw logits each output token was sampled from, one [vocab] row each
    generation_logits: "list[torch.Tensor] | None" = field(default=None, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_output_tokens: int
    # Speculative decoding: tokens proposed for this request, and how many the target accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = field(default=None, repr=False)
    num_cached_tokens: int | None = None  # prompt tokens whose K/V came from the prefix cache
    # return_context_logits: [num_prompt_tokens, vocab] raw logits (row p predicts prompt token p + 1;
    # the last row is the one the first output token was sampled from), once the prompt is computed
    context_logits: "torch.Tensor | None" = field(default=None, repr=False)
