"""What the frontend and the engine core say to each other, in one thread or across a pipe.

The frontend (kiln/runtime/frontend/) sends `EngineCoreRequest`s (and aborts); the core
(kiln/runtime/core/) answers each step with `EngineCoreOutputs`: per request, the new token ids of
each sample and what else was asked for, with the scheduler's stats. `EngineInfo` is what the
frontend knows of a loaded core to check requests before sending them. Every message pickles by
value (kiln/runtime/frontend/core_client.py sends them to a core process).
"""
import pickle
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import torch

from kiln.runtime.sampling_params import SamplingParams


class Pipe(Connection):
    """A connection that pickles by value. multiprocessing's pickler sends a tensor's storage as a
    file descriptor fetched from the sender's resource sharer, which authenticates with
    multiprocessing's per-process key: a core started by subprocess has another one."""

    def send(self, obj) -> None:
        self.send_bytes(pickle.dumps(obj, pickle.HIGHEST_PROTOCOL))

    def recv(self):
        return pickle.loads(self.recv_bytes())


class EngineDeadError(RuntimeError):
    """The engine core stopped (its process, or one of its ranks, died or was killed): every pending
    and later request fails with this error. vLLM's name; the frontend has to be restarted."""


@dataclass
class EngineCoreRequest:
    """A request as the frontend sends it: validated, tokenized, its max_tokens bounded."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    cache_salt: str | None = None  # requests with different salts never share cached blocks
    lora_request: object = None  # kiln.runtime.lora_request.LoRARequest


@dataclass
class SampleDelta:
    """What one sample of a request did this step."""
    index: int
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None  # "stop" (EOS, a stop token id), "length", "abort"
    stop_reason: int | None = None  # the stop token id
    new_generation_logits: list[torch.Tensor] | None = None  # return_generation_logits: a row per token
    cumulative_logprob: float | None = None  # beam search: the hypothesis's, sent whole when the search ends


@dataclass
class EngineCoreOutput:
    request_id: str
    samples: list[SampleDelta]
    new_prompt_logprobs: list[dict[int, float]] | None
    first_scheduled_time: float | None
    first_token_time: float | None
    finished: bool
    num_cached_tokens: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    context_logits: torch.Tensor | None = None  # return_context_logits: once the whole prompt is computed


@dataclass
class IterationStats:
    """What the engine's steps did (TensorRT-LLM's iteration stats): totals since the engine started
    and the batch of the last step, for metrics that show whether in-flight batching happens."""
    num_iterations: int = 0
    num_multi_request_iterations: int = 0  # steps whose batch held more than one sequence
    num_mixed_iterations: int = 0  # steps that computed a prompt beside sequences generating
    # The last step. A sequence is "context" in a step that computes any of its prompt.
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_context_tokens: int = 0
    num_generation_requests: int = 0
    num_paused_requests: int = 0  # preempted sequences waiting to be recomputed

    def record(self, scheduled: list, waiting) -> None:
        """A step's (sequence, new tokens) pairs, before the step advances their computed tokens,
        and the sequences left waiting."""
        context = [n for seq, n in scheduled if seq.num_computed_tokens < seq.request.num_prompt_tokens]
        self.num_iterations += 1
        self.num_scheduled_requests = len(scheduled)
        self.num_context_requests = len(context)
        self.num_context_tokens = sum(context)
        self.num_generation_requests = len(scheduled) - len(context)
        self.num_multi_request_iterations += len(scheduled) > 1
        self.num_mixed_iterations += bool(context) and self.num_generation_requests > 0
        self.num_paused_requests = sum(seq.num_output_tokens > 0 for seq in waiting)


@dataclass
class SpecStats:
    """Speculative decoding, cumulative (vLLM's spec_decode counters)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats:
    num_requests_running: int
    num_requests_waiting: int
    num_kv_blocks: int
    num_free_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int = 0  # tokens, cumulative
    prefix_cache_hits: int = 0
    spec: SpecStats | None = None
    iterations: IterationStats | None = None
    # LoRA engines: adapters in the engine's slots, those held by running sequences, and the slots
    lora_loaded: int | None = None
    lora_active: int | None = None
    max_loras: int | None = None


def stats_dict(stats: SchedulerStats) -> dict:
    """The stats as one flat dict (LLMEngine.get_stats, AsyncLLM.stats, the metrics exporters)."""
    d = asdict(stats)
    d.update(d.pop("iterations") or {})
    return d


@dataclass
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    # (request ids, message): a step failed; those requests are gone from the core.
    errors: list[tuple[list[str], str]] = field(default_factory=list)


def blocks_for(num_tokens: int, tokens_per_block: int) -> int:
    return -(-num_tokens // tokens_per_block)


def request_blocks(num_prompt_tokens: int, max_len: int, n: int, tokens_per_block: int,
                   long_rope_threshold: int = 0) -> tuple[int, int]:
    """Blocks a request can ever hold at once: (all n samples, each forked sample's own share).
    The n samples share the prompt's full blocks; the rest each sample grows on its own. A LongRoPE
    sample growing past the threshold is recomputed into new blocks while the old may still be shared."""
    per_sample = blocks_for(max_len, tokens_per_block)
    if long_rope_threshold and num_prompt_tokens <= long_rope_threshold < max_len:
        per_sample += blocks_for(long_rope_threshold + 1, tokens_per_block)
    own = per_sample - num_prompt_tokens // tokens_per_block
    return per_sample + (n - 1) * own, own


@dataclass
class EngineInfo:
    """What the frontend needs to know of a loaded core to validate and tokenize requests."""
    build_config: object
    model_config: object
    max_batch_size: int
    max_num_tokens: int
    num_kv_blocks: int
    tokens_per_block: int
    scheduler_policy: str
    enable_chunked_prefill: bool
    threads: int
    enable_prefix_caching: bool
    max_model_len: int  # prompt + output tokens of a request (at most the engine's max_seq_len)

    def blocks_needed(self, num_prompt_tokens: int, max_tokens: int, n: int, together: bool = False) -> int:
        """The KV blocks a request must be able to hold at once to ever finish (together: its n
        sequences all at once, as a beam search's beams step)."""
        tpb, total = self.tokens_per_block, num_prompt_tokens + max_tokens
        if self.scheduler_policy == "guaranteed_no_evict" or together:
            return request_blocks(num_prompt_tokens, total, n, tpb, self.model_config.long_rope_threshold)[0]
        # samples may take turns (preemption), but the fork needs the prompt + n - 1 blocks at once
        return max(blocks_for(total, tpb), blocks_for(num_prompt_tokens, tpb) + n - 1)
