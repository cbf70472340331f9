"""What a request asks for at its prompt positions: prompt logprobs (vLLM's `prompt_logprobs`) and
the raw context logits (TensorRT-LLM's `return_context_logits`).

Each is taken from the logits of the prompt positions a step computes (kiln/runtime/core/step_plan.py
asks for those rows), from `next_position` on: after a preemption the positions already taken are
not taken again. A position served by the prefix cache has no logits, so the request lets the cache
serve none from the first position still owed (`Request.cacheable_tokens`).
"""
import torch

from kiln.runtime.core.sample.rows import compute_prompt_logprobs
from kiln.runtime.messages import EngineCoreOutput
from kiln.runtime.sampling_params import SamplingParams


class PromptLogprobs:
    """Position p's logits score prompt token p + 1; the first token has no logprobs (None)."""

    def __init__(self, top_n: int, prompt_token_ids: list[int]):
        self.top_n, self.prompt_token_ids = top_n, prompt_token_ids
        self.next_position = 0  # the frontend keeps the logprobs; the core only how far they have got
        self.end = len(prompt_token_ids) - 1  # the last position scores nothing

    def take(self, logits: torch.Tensor, output: EngineCoreOutput) -> None:
        first = self.next_position + 1
        output.new_prompt_logprobs = compute_prompt_logprobs(
            logits, self.prompt_token_ids[first:first + len(logits)], self.top_n)
        self.next_position += len(logits)


class ContextLogits:
    """The logits of every prompt position, sent once all are computed."""

    def __init__(self, prompt_token_ids: list[int]):
        self.logits: torch.Tensor | None = None
        self.end = len(prompt_token_ids)

    @property
    def next_position(self) -> int:
        return 0 if self.logits is None else len(self.logits)

    def take(self, logits: torch.Tensor, output: EngineCoreOutput) -> None:
        self.logits = logits if self.logits is None else torch.cat([self.logits, logits])
        if len(self.logits) == self.end:
            output.context_logits = self.logits


PromptOutput = PromptLogprobs | ContextLogits


def prompt_outputs(params: SamplingParams, prompt_token_ids: list[int]) -> tuple[PromptOutput, ...]:
    outputs = []
    if params.prompt_logprobs is not None:
        outputs.append(PromptLogprobs(params.prompt_logprobs, prompt_token_ids))
    if params.return_context_logits:
        outputs.append(ContextLogits(prompt_token_ids))
    return tuple(outputs)
