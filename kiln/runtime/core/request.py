"""A request and its sequences in the engine core (n > 1 samples fork from one prefilled prompt; a
beam search's beams are its sequences: request_group.py's policies make them)."""
import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kiln.runtime.core.prompt_logits import PromptOutput, prompt_outputs
from kiln.runtime.core.sample.rows import SeedGenerator
from kiln.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # one sequence is equal only to itself (lists of them, sets of those in flight)
class Sequence:
    request: "Request"
    index: int  # which of the request's n samples
    token_ids: list[int]  # prompt + generated
    generator: SeedGenerator | None = None  # a seeded request's draws (counter-based: nothing to carry)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    row: int = -1  # its row of the KV cache manager's block_tables while it holds blocks
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of its full blocks so far
    num_cached_blocks: int = 0  # leading blocks of block_table that are in the prefix cache
    long_rope: bool = False  # LongRoPE: its K/V are rotated with the long factors (kv_cache_manager.py)
    draft_token_ids: list[int] = field(default_factory=list)  # proposed for this step, to be verified
    reserved_blocks: int = 0  # guaranteed_no_evict: blocks promised but not yet taken
    finish_reason: str | None = None
    matcher: object = None  # guided decoding: its xgrammar GrammarMatcher (structured_output.py)

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


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens bounded by the engine's max_seq_len
    eos_token_ids: tuple[int, ...] = ()
    extra_keys: tuple = ()  # what else changes its K/V besides the tokens (a cache salt): in every block hash
    lora_request: object = None  # its LoRA adapter (kiln.runtime.lora_request.LoRARequest)
    lora_slot: int = -1  # the engine slot its adapter is in while a sequence of it runs (kiln/lora/slots.py)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    sequences: list[Sequence] = field(default_factory=list)
    forked: bool = False  # the n samples exist (after the prompt's last chunk)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    num_draft_tokens: int = 0  # speculative decoding: proposed, and accepted by the target
    num_accepted_tokens: int = 0
    spec_counts: list | None = None  # per draft position: [accepted], [verified] (spec_policy.Acceptance)
    grammar: Future | None = None  # guided decoding: its grammar, compiling or compiled (structured_output.py)
    group: object = None  # how its sequences are made and advance (request_group.py)
    # What it asked for at prompt positions (prompt logprobs, context logits), taken step by step.
    prompt_outputs: tuple[PromptOutput, ...] = field(init=False)

    def __post_init__(self):
        self.prompt_outputs = prompt_outputs(self.params, self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def cacheable_tokens(self) -> int:
        """How many of its first tokens the prefix cache may serve: none from the first prompt position
        whose logits are still owed, which must be computed."""
        return min((o.next_position for o in self.prompt_outputs), default=self.max_len)

    @property
    def max_len(self) -> int:
        """Prompt + the most tokens a sample may generate (max_tokens is already bounded by max_seq_len)."""
        return self.num_prompt_tokens + self.max_tokens

    @property
    def finished(self) -> bool:
        return self.forked and all(s.finished for s in self.sequences)
