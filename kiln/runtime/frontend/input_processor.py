"""The frontend's side of a new request: its prompt tokenized and every limit of the engine checked,
so that a request the core receives always fits. This is the one place a prompt is checked (token
ids in the vocabulary, not empty, its length against max_input_len, max_model_len, max_num_tokens
and the KV cache), for `LLM`, `AsyncLLM` and `kiln serve` alike: each refusal is an
`InvalidRequestError` naming the limit, the value and the request field at fault."""
import time

from kiln.runtime.frontend.output_processor import RequestState
from kiln.runtime.messages import EngineCoreRequest, EngineInfo
from kiln.runtime.sampling_params import InvalidRequestError, SamplingParams


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
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r}", "cache_salt")
        build, info = self.info.build_config, self.info
        if not token_ids:
            raise InvalidRequestError("prompt is empty (it has no tokens)", "prompt")
        if len(token_ids) > build.max_input_len:
            raise InvalidRequestError(f"prompt has {len(token_ids)} tokens, more than the engine's max_input_len "
                                      f"({build.max_input_len})", "prompt")
        limit = ("engine's max_seq_len" if info.max_model_len == build.max_seq_len else "max_model_len")
        if info.max_model_len < build.max_seq_len and len(token_ids) >= info.max_model_len:
            raise InvalidRequestError(f"The decoder prompt (length {len(token_ids)}) is longer than the maximum "
                                      f"model length of {info.max_model_len} (max_model_len)", "prompt")
        room = info.max_model_len - len(token_ids)
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if max_tokens > room:
            raise InvalidRequestError(f"max_tokens ({max_tokens}) + prompt ({len(token_ids)} tokens) exceeds the "
                                      f"{limit} ({info.max_model_len})", "max_tokens")
        if params.n > info.max_batch_size:
            raise InvalidRequestError(f"n ({params.n}) exceeds max_batch_size ({info.max_batch_size})", "n")
        width = params.beam_width  # best_of, else n: no one field
        if width > build.max_beam_width:
            raise InvalidRequestError(f"beam width {width} exceeds the engine's max_beam_width "
                                      f"({build.max_beam_width}); rebuild it with engine-build "
                                      f"--max_beam_width {width}")
        if width > info.max_batch_size:
            raise InvalidRequestError(f"beam width {width} exceeds max_batch_size ({info.max_batch_size}): every "
                                      f"beam takes a batch slot")
        if not info.enable_chunked_prefill and len(token_ids) > info.max_num_tokens:
            raise InvalidRequestError(f"prompt has {len(token_ids)} tokens, more than max_num_tokens "
                                      f"({info.max_num_tokens}) allows without chunked prefill", "prompt")
        if info.blocks_needed(len(token_ids), max_tokens, params.num_sequences, params.use_beam_search) \
                > info.num_kv_blocks:
            raise InvalidRequestError(f"prompt + max_tokens ({len(token_ids) + max_tokens} tokens, "
                                      f"{'beams' if params.use_beam_search else 'n'}={params.num_sequences}) does "
                                      f"not fit in the KV cache ({info.num_kv_blocks * info.tokens_per_block} tokens)",
                                      "prompt")
        if params.guided_decoding is not None:
            params.guided_decoding.check()  # a guide that does not parse fails here, not in the core
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer, and this engine was loaded with "
                                      "skip_tokenizer_init; use stop_token_ids", "stop")
        now = time.monotonic()
        return (EngineCoreRequest(request_id, token_ids, params, max_tokens, self.eos_token_ids, now, salt,
                                  lora_request),
                RequestState(request_id, text, token_ids, params, now))

    def check_lora(self, lora) -> None:
        """The adapter is one the engine runs (read once per lora_int_id; a bad one fails its request)."""
        from kiln.lora.adapter import check_adapter, read_adapter
        from kiln.runtime.lora_request import LoRARequest

        if not isinstance(lora, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {type(lora).__name__}", "lora_request")
        lora_config = self.info.build_config.lora_config
        if lora_config is None:
            raise InvalidRequestError(f"request names LoRA adapter {lora.lora_name!r}, but the engine was built "
                                      f"without adapters (engine-build --lora_plugin auto --lora_target_modules ...)",
                                      "lora_request")
        known = self.loras.get(lora.lora_int_id)
        if known is not None and known != str(lora.lora_path):
            raise InvalidRequestError(f"lora_int_id {lora.lora_int_id} names {known}; {lora.lora_path} needs an id "
                                      f"of its own", "lora_request")
        if known is None:
            check_adapter(read_adapter(lora.lora_path, self.info.model_config), self.info.model_config, lora_config)
            self.loras[lora.lora_int_id] = str(lora.lora_path)

    def check_token_ids(self, token_ids: list[int], parameter: str = "prompt") -> None:
        """Every id is one of the model's (a prompt's, or the ids `kiln serve`'s /detokenize is given)."""
        vocab = self.info.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            what = "prompt token id" if parameter == "prompt" else "token id"
            raise InvalidRequestError(f"{what} {bad} is outside the vocabulary [0, {vocab})", parameter)

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("prompt is text, but this engine was loaded with skip_tokenizer_init "
                                          "(kiln serve --skip-tokenizer-init): send its token ids, "
                                          "{'prompt_token_ids': [...]} (to /v1/completions, a list of ints)", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequestError("prompt_token_ids must be a list of ints", "prompt")
            self.check_token_ids(ids)
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"])
        raise InvalidRequestError(f"a prompt must be a string or a dict with 'prompt_token_ids'; got "
                                  f"{type(prompt).__name__}", "prompt")
