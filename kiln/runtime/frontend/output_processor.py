"""The frontend's side of a request: the engine core's new token ids become text and RequestOutputs.

Each sample is detokenized incrementally here, and its stop strings are looked for here: the core
never sees text. A sample that meets a stop string ends at the token that completed it; the
tokens the core made after it (it runs ahead while the frontend detokenizes) are dropped, and the
caller aborts the sample in the core.
"""
import time
from dataclasses import dataclass, field

from kiln.runtime.frontend.detokenizer import IncrementalDetokenizer
from kiln.runtime.messages import EngineCoreOutput
from kiln.runtime.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.sampling_params import SamplingParams


@dataclass
class SampleState:
    index: int
    detokenizer: IncrementalDetokenizer | None  # None: the engine runs without a tokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: list | None = None  # return_generation_logits: the rows its tokens were drawn from

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    samples: dict[int, SampleState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, float] | None] | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    context_logits: object = None  # return_context_logits: [prompt tokens, vocab], once all are computed

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.finish_reason for s in self.samples.values())


class OutputProcessor:
    def __init__(self, tokenizer, max_seq_len: int):
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.requests: dict[str, RequestState] = {}

    def add(self, state: RequestState) -> None:
        if state.params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        state.samples[0] = self._new_sample(state, 0)  # the others appear when the prompt is computed
        self.requests[state.request_id] = state

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[tuple[str, int]]]:
        """The RequestOutputs of the requests these core outputs advanced, and the (request id,
        sample index) pairs that met a stop string, for the caller to abort in the core."""
        results, stopped = [], []
        now = time.monotonic()
        for o in outputs:
            state = self.requests.get(o.request_id)
            if state is None:  # aborted here while the core was stepping it
                continue
            state.first_scheduled_time = o.first_scheduled_time
            state.first_token_time = state.first_token_time or o.first_token_time
            state.num_cached_tokens = o.num_cached_tokens
            state.num_draft_tokens, state.num_accepted_tokens = o.num_draft_tokens, o.num_accepted_tokens
            if o.new_prompt_logprobs:
                state.prompt_logprobs.extend(o.new_prompt_logprobs)
            if o.context_logits is not None:
                state.context_logits = o.context_logits
            for delta in o.samples:
                sample = state.samples.get(delta.index)
                if sample is None:
                    sample = state.samples[delta.index] = self._new_sample(state, delta.index)
                if sample.finish_reason is None and self._advance(state, sample, delta) and \
                        delta.finish_reason is None:
                    stopped.append((state.request_id, delta.index))
            if state.finished:
                state.finished_time = now
                del self.requests[state.request_id]
            results.append(self.output(state))
        return results, stopped

    def abort(self, request_id: str) -> RequestOutput | None:
        """End the request here: its unfinished samples end with finish_reason "abort"."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return None
        for index in range(state.params.n):
            sample = state.samples.get(index) or state.samples.setdefault(index, self._new_sample(state, index))
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        state.finished_time = time.monotonic()
        return self.output(state)

    def _new_sample(self, state: RequestState, index: int) -> SampleState:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, state.prompt_token_ids, state.params.skip_special_tokens)
        return SampleState(index, detok, generation_logits=[] if state.params.return_generation_logits else None)

    def _advance(self, state: RequestState, sample: SampleState, delta) -> bool:
        """Take the sample's new tokens; True if a stop string ended it."""
        params = state.params
        last = len(delta.new_token_ids) - 1
        for i, token in enumerate(delta.new_token_ids):
            sample.token_ids.append(token)
            if delta.new_logprobs is not None:
                sample.logprobs.append(delta.new_logprobs[i])
                sample.cumulative_logprob += delta.new_logprobs[i][token]
            if delta.new_generation_logits is not None:
                sample.generation_logits.append(delta.new_generation_logits[i])
            text = sample.detokenizer.add(token) if sample.detokenizer is not None else ""
            # EOS and stop token ids (decided by the core) come before stop strings, as in vLLM.
            core_stop = i == last and delta.finish_reason in ("stop", "abort")
            if params.stop and text and not core_stop and len(sample.token_ids) > params.min_tokens \
                    and self._stop_string(sample, text, params):
                return True
        if delta.cumulative_logprob is not None:
            sample.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = delta.finish_reason, delta.stop_reason
            if sample.detokenizer is not None:
                sample.detokenizer.flush()
        return False

    @staticmethod
    def _stop_string(sample: SampleState, delta: str, params: SamplingParams) -> bool:
        """Whether the text `delta` added completes one of the stop strings; then the text is cut
        where it begins (or after it, with include_stop_str_in_output)."""
        detok = sample.detokenizer
        text = detok.text
        window_start = max(0, len(text) - len(delta) - max(len(s) for s in params.stop) + 1)
        hits = [(pos, s) for pos, s in ((text.find(s, window_start), s) for s in params.stop) if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        detok.text = text[:pos + len(stop) if params.include_stop_str_in_output else pos]
        sample.finish_reason, sample.stop_reason = "stop", stop
        return True

    def output(self, state: RequestState) -> RequestOutput:
        want_lp = state.params.logprobs is not None
        scored = want_lp or state.params.use_beam_search
        samples = [state.samples[i] for i in sorted(state.samples)]
        outputs = [CompletionOutput(
            index=s.index, text=s.text, token_ids=list(s.token_ids),
            cumulative_logprob=s.cumulative_logprob if scored else None,
            logprobs=list(s.logprobs) if want_lp else None,
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            generation_logits=None if s.generation_logits is None else list(s.generation_logits)) for s in samples]
        metrics = RequestMetrics(state.arrival_time, state.first_scheduled_time, state.first_token_time,
                                 state.finished_time, max((len(s.token_ids) for s in samples), default=0),
                                 state.num_draft_tokens, state.num_accepted_tokens)
        return RequestOutput(state.request_id, state.prompt, list(state.prompt_token_ids),
                             None if state.prompt_logprobs is None else list(state.prompt_logprobs),
                             outputs, state.finished, metrics, state.num_cached_tokens, state.context_logits)
