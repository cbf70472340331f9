"""`LLM`: synchronous batch generation, vLLM's API."""
from collections.abc import Sequence

from kiln.runtime.frontend.llm_engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.utils import progress


class LLM:
    """Generates from an engine dir. Keyword arguments go to `LLMEngine` (scheduler policy, KV cache
    size, `max_batch_size`/`max_num_tokens` below the build limits, `threads`, and `engine_core`:
    "inproc" runs the engine core in this thread, "process" in a process of its own)."""

    def __init__(self, engine_dir, **engine_args):
        self.llm_engine = LLMEngine(engine_dir, **engine_args)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, lora_request=None) -> list[RequestOutput]:
        """lora_request: a LoRARequest for every prompt, or a list of one (or None) per prompt."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict or a list of them; got {type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts")
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params, lora in zip(prompts, sampling_params, loras):
                ids.append(engine.add_request(prompt, params, lora_request=lora))
        except Exception:
            for rid in ids:
                engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        with progress(total=len(ids), desc="generate", disable=not use_tqdm) as bar:
            try:
                while len(results) < len(ids):
                    for out in engine.step():
                        if out.finished:
                            results[out.request_id] = out
                            bar.update(1)
            except BaseException:
                for rid in ids:
                    engine.abort(rid)
                raise
        return [results[rid] for rid in ids]
