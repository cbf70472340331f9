"""What the engine's steps did (TensorRT-LLM's iteration stats): totals since the engine started and
the batch of the last step, for metrics that show whether in-flight batching happens."""
from dataclasses import dataclass

from kiln.runtime.scheduler import Scheduler, SchedulerOutput


@dataclass
class IterationStats:
    num_iterations: int = 0
    num_multi_request_iterations: int = 0  # steps whose batch held more than one sequence
    num_mixed_iterations: int = 0  # steps that computed a prompt beside sequences generating
    # The last step. A sequence is "context" in a step that computes any of its prompt.
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_context_tokens: int = 0
    num_generation_requests: int = 0
    num_paused_requests: int = 0  # preempted sequences waiting to be recomputed

    def record(self, out: SchedulerOutput, scheduler: Scheduler) -> None:
        """Call before the step advances its sequences' computed tokens."""
        context = [n for seq, n in out.scheduled if seq.num_computed_tokens < seq.request.num_prompt_tokens]
        self.num_iterations += 1
        self.num_scheduled_requests = len(out.scheduled)
        self.num_context_requests = len(context)
        self.num_context_tokens = sum(context)
        self.num_generation_requests = len(out.scheduled) - len(context)
        self.num_multi_request_iterations += len(out.scheduled) > 1
        self.num_mixed_iterations += bool(context) and self.num_generation_requests > 0
        self.num_paused_requests = sum(seq.num_output_tokens > 0 for seq in scheduler.waiting)
