"""The frontend's side of a new request: its prompt tokenized and every limit of the engine checked,
so that a request the core receives always fits (the errors name the limit and the value)."""
import time

from kiln.runtime.frontend.output_processor import RequestState
from kiln.runtime.messages import EngineCoreRequest, EngineInfo
from kiln.runtime.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, info: EngineInfo, tokenizer, eos_token_ids: tuple[int, ...]):
        self.info, self.tokenizer, self.eos_token_ids = info, tokenizer, eos_token_ids
        self.loras: dict[int, str] = {}  # adapters checked: lora_int_id -> path

    def process(self, request_id: str, prompt, params: SamplingParams | None,
                lora_request=None) -> tuple[EngineCoreRequest, RequestState]:
        params = params or SamplingParams()
        if lora_request is not None:
            self.check_lora(lora_request)
        text, token_ids = self._tokenize(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        build, info = self.info.build_config, self.info
        if not token_ids:
            raise ValueError("prompt is empty (it has no tokens)")
        if len(token_ids) > build.max_input_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the engine's max_input_len "
                             f"({build.max_input_len})")
        limit = ("engine's max_seq_len" if info.max_model_len == build.max_seq_len else "max_model_len")
        if info.max_model_len < build.max_seq_len and len(token_ids) >= info.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(token_ids)}) is longer than the maximum model length "
                             f"of {info.max_model_len} (max_model_len)")
        room = info.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise ValueError(f"max_tokens ({max_tokens}) + prompt ({len(token_ids)} tokens) exceeds the "
                             f"{limit} ({info.max_model_len})")
        if params.n > info.max_batch_size:
            raise ValueError(f"n ({params.n}) exceeds max_batch_size ({info.max_batch_size})")
        width = params.beam_width
        if width > build.max_beam_width:
            raise ValueError(f"beam width {width} exceeds the engine's max_beam_width ({build.max_beam_width}); "
                             f"rebuild it with engine-build --max_beam_width {width}")
        if width > info.max_batch_size:
            raise ValueError(f"beam width {width} exceeds max_batch_size ({info.max_batch_size}): every beam "
                             f"takes a batch slot")
        if not info.enable_chunked_prefill and len(token_ids) > info.max_num_tokens:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than max_num_tokens "
                             f"({info.max_num_tokens}) allows without chunked prefill")
        if info.blocks_needed(len(token_ids), max_tokens, params.num_sequences, params.use_beam_search) \
                > info.num_kv_blocks:
            raise ValueError(f"prompt + max_tokens ({len(token_ids) + max_tokens} tokens, "
                             f"{'beams' if params.use_beam_search else 'n'}={params.num_sequences}) does not "
                             f"fit in the KV cache ({info.num_kv_blocks * info.tokens_per_block} tokens)")
        if params.guided_decoding is not None:
            params.guided_decoding.check()  # a guide that does not parse fails here, not in the core
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this engine was loaded with "
                             "skip_tokenizer_init; use stop_token_ids")
        now = time.monotonic()
        return (EngineCoreRequest(request_id, token_ids, params, max_tokens, self.eos_token_ids, now, salt,
                                  lora_request),
                RequestState(request_id, text, token_ids, params, now))

    def check_lora(self, lora) -> None:
        """The adapter is one the engine runs (read once per lora_int_id; a bad one fails its request)."""
        from kiln.lora.adapter import check_adapter, read_adapter
        from kiln.runtime.lora_request import LoRARequest

        if not isinstance(lora, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora).__name__}")
        lora_config = self.info.build_config.lora_config
        if lora_config is None:
            raise ValueError(f"request names LoRA adapter {lora.lora_name!r}, but the engine was built without "
                             f"adapters (engine-build --lora_plugin auto --lora_target_modules ...)")
        known = self.loras.get(lora.lora_int_id)
        if known is not None and known != str(lora.lora_path):
            raise ValueError(f"lora_int_id {lora.lora_int_id} names {known}; {lora.lora_path} needs an id of its own")
        if known is None:
            check_adapter(read_adapter(lora.lora_path, self.info.model_config), self.info.model_config, lora_config)
            self.loras[lora.lora_int_id] = str(lora.lora_path)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt is text, but this engine was loaded with skip_tokenizer_init: "
                                 "send {'prompt_token_ids': [...]}")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            vocab = self.info.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise ValueError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got {type(prompt).__name__}")
