"""`LLMEngine`: the synchronous frontend. Prompts in, `RequestOutput`s out, one engine step at a time.

Tokenizing and checking a request (input_processor.py), detokenizing and stop strings
(output_processor.py) happen here; the engine core (kiln/runtime/core/engine_core.py) runs in this
thread (`engine_core="inproc"`, the default) or in a process of its own (`"process"`), where it
steps ahead while this side turns the last step into text.
"""
import itertools

from kiln.runtime.frontend.core_client import InprocClient, make_client
from kiln.runtime.frontend.input_processor import InputProcessor
from kiln.runtime.frontend.output_processor import OutputProcessor
from kiln.runtime.frontend.tokenizer import eos_token_ids, frontend_tokenizer
from kiln.runtime.messages import stats_dict
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


class LLMEngine:
    """Keyword arguments go to the engine core: scheduler_policy, enable_chunked_prefill,
    max_batch_size / max_num_tokens (below the build limits), kv_cache_free_mem_fraction,
    max_tokens_in_paged_kv_cache, threads."""

    def __init__(self, engine_dir, *, engine_core: str = "inproc", tokenizer=None, skip_tokenizer_init: bool = False,
                 **core_args):
        self.tokenizer = frontend_tokenizer(engine_dir, tokenizer, skip_tokenizer_init)
        self.client = make_client(engine_dir, engine_core, core_args)
        info = self.client.info
        self.build_config, self.model_config, self.threads = info.build_config, info.model_config, info.threads
        self.input_processor = InputProcessor(info, self.tokenizer, eos_token_ids(self.model_config, self.tokenizer))
        self.output_processor = OutputProcessor(self.tokenizer, self.build_config.max_seq_len)
        self._ids = itertools.count()
        self._stats = None

    @property
    def core(self):
        """The engine core itself, when it runs in this thread (tests, profiling)."""
        return self.client.core

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    lora_request=None) -> str:
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.output_processor.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        core_request, state = self.input_processor.process(request_id, prompt, params, lora_request)
        self.output_processor.add(state)
        self.client.add_request(core_request)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.output_processor.abort(str(request_id))
        if out is not None:
            self.client.abort(str(request_id))
        return out

    def has_unfinished_requests(self) -> bool:
        return bool(self.output_processor.requests)

    def get_stats(self) -> dict:
        """The core's load, KV cache and step counters now (in this thread) or as of its last step."""
        stats = self.core.stats() if isinstance(self.client, InprocClient) else self._stats
        return stats_dict(stats) if stats is not None else {}

    def step(self) -> list[RequestOutput]:
        if not self.has_unfinished_requests():
            return []
        core_outputs = self.client.get_outputs()
        if core_outputs.errors:
            ids, message = core_outputs.errors[0]
            for rid in ids:
                self.output_processor.abort(rid)
            raise RuntimeError(f"engine step failed: {message}")
        self._stats = core_outputs.stats
        outputs, stopped = self.output_processor.process(core_outputs.outputs)
        for request_id, index in stopped:
            self.client.abort(request_id, index)
        return outputs

    def shutdown(self) -> None:
        self.client.shutdown()
