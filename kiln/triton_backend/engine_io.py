"""The `tensorrt_llm` model's tensors, TensorRT-LLM's names and semantics: a Triton request's inputs
to one engine request per batch row, and engine outputs to response tensors. Numpy only (no Triton
imports), so that the rules are tested without a server.

Responses follow TensorRT-LLM: non-streaming, one response per sequence when it finishes, its
`output_ids` the prompt + generated tokens (`exclude_input_in_output`: generated only); streaming,
each response carries the new tokens only. The end token (`end_id`, or the engine's EOS without
one) ends a sequence and is not part of its output.
A streamed token is held back until it completes text (a multi-byte character split over tokens),
and `prefix_ids` carries the tokens before a response's, so that postprocessing decodes them in
context. As TensorRT-LLM's backend: `context_logits` ([1, prompt, vocab]) rides on every response;
`generation_logits` is [1, 1, max_tokens, vocab] when not streaming (zero past the sequence's end)
and [1, new tokens, 1, vocab] per streamed response; `num_output_tokens` counts the tokens of that
response's output_ids. A beam search (`beam_width` > 1) answers once, when it ends, streaming or
not: its best `num_return_sequences` beams (all by default), best first, as [1, beams, ...] tensors
(`output_ids` padded with pad_id, `sequence_length` and `cum_log_probs` [1, beams])."""
import time
from dataclasses import dataclass, field

import numpy as np

from kiln.runtime.outputs import CompletionOutput, RequestOutput
from kiln.runtime.sampling_params import GuidedDecodingParams, SamplingParams
from kiln.triton_backend.sampling import sampling_fields

# Inputs a client may send for features the engine lacks: refused by name, never ignored.
REFUSED = {
    **dict.fromkeys(("draft_input_ids", "draft_logits", "draft_acceptance_threshold", "num_draft_tokens",
                     "use_draft_logits"), "speculative decoding (draft tokens) is not supported yet"),
    "embedding_bias": "embedding bias is not supported yet",
    **dict.fromkeys(("prompt_embedding_table", "prompt_vocab_size", "prompt_table_extra_ids"),
                    "prompt tables (p-tuning) are not supported yet"),
    **dict.fromkeys(("runtime_top_p_min", "runtime_top_p_decay", "runtime_top_p_reset_ids"),
                    "top-p decay is not supported"),
    **dict.fromkeys(("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size"),
                    "lookahead decoding is not supported yet"),
}
PREFIX_CONTEXT = 6  # tokens of context a streamed response carries for detokenization


class RequestError(ValueError):
    pass


# TensorRT-LLM's guided_decoding_guide_type values -> GuidedDecodingParams fields ("json": any JSON object)
GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar",
               "structural_tag": "structural_tag"}


def _text(value) -> str | None:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else value


def guided_decoding(guide_type, guide) -> GuidedDecodingParams | None:
    """The guided_decoding_guide_type / guided_decoding_guide inputs as a guide, checked."""
    guide_type, guide = _text(guide_type), _text(guide)
    if guide_type in (None, "", "none"):
        if guide:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    if guide_type not in GUIDE_TYPES:
        raise RequestError(f"guided_decoding_guide_type {guide_type!r} is not supported; expected one of "
                           f"{', '.join(GUIDE_TYPES)}")
    field = GUIDE_TYPES[guide_type]
    if field != "json_object" and not guide:
        raise RequestError(f"guided_decoding_guide_type {guide_type} needs guided_decoding_guide")
    try:
        params = GuidedDecodingParams(**{field: True if field == "json_object" else guide})
        params.check()
    except ValueError as e:
        detail = str(e).split(" is not valid: ", 1)
        raise RequestError(f"guided_decoding_guide ({guide_type}) is not valid: {detail[-1]}") from None
    return params


@dataclass
class Row:
    """One batch row of a Triton request: one engine request."""
    prompt: list[int]
    params: SamplingParams
    streaming: bool
    exclude_input: bool
    end_id: int | None  # stops the sequence; left out of its output
    pad_id: int
    log_probs: bool
    perf_metrics: bool
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    # LoRA: the adapter's task id, and (its first request) its weights and config in TensorRT-LLM's format
    lora_task_id: int | None = None
    lora_weights: object = None
    lora_config: object = None


def _scalar(tensors: dict, name: str, batch: int, row: int):
    value = tensors.get(name)
    if value is None:
        return None
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1 and flat.size != batch:
        raise RequestError(f"{name} must hold one value per batch row ({batch}), got shape {list(np.shape(value))}")
    item = flat[0 if flat.size == 1 else row]
    return item.item() if isinstance(item, np.generic) else item  # a STRING input's element is bytes


def word_list(value, name: str) -> list[list[int]]:
    """TensorRT-LLM's [2, L] word list: token ids, then each word's end offset (-1 padded)."""
    arr = np.asarray(value).reshape(2, -1) if np.size(value) else np.zeros((2, 0), np.int32)
    ids, offsets = arr[0].tolist(), arr[1].tolist()
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        if not start < end <= len(ids):
            raise RequestError(f"{name}: bad word offsets {offsets} for {len(ids)} token ids")
        words.append(ids[start:end])
        start = end
    return words


def lora_inputs(tensors: dict, batch: int, row: int) -> tuple:
    """(lora_task_id, lora_weights, lora_config) of a batch row: 0 or no id is no adapter; weights and
    config come together, with an id (TensorRT-LLM's cache keys them by it)."""
    task = _scalar(tensors, "lora_task_id", batch, row)
    weights, config = tensors.get("lora_weights"), tensors.get("lora_config")
    if (weights is None) != (config is None):
        raise RequestError("lora_weights and lora_config come together (the adapter's rows and their module, "
                           "layer and rank)")
    if weights is not None:
        if not task:
            raise RequestError("lora_weights and lora_config need a lora_task_id (>= 1) to cache the adapter under")
        weights, config = np.asarray(weights), np.asarray(config)
        if weights.ndim == 3:
            weights, config = weights[row if len(weights) == batch else 0], config[row if len(config) == batch else 0]
    return (task or None), weights, config


def parse_request(tensors: dict, *, decoupled: bool, exclude_input_default: bool, vocab_size: int,
                  tokenizer, max_beam_width: int = 1) -> tuple[bool, list[Row]]:
    """(stop request?, rows). RequestError names the input that is wrong and what was expected."""
    for name in tensors:
        if name in REFUSED:
            raise RequestError(f"input {name}: {REFUSED[name]}; send the request without it")
    ids = tensors.get("input_ids")
    if ids is None:
        raise RequestError("input_ids is required")
    ids = np.asarray(ids)
    ids = ids.reshape(1, -1) if ids.ndim == 1 else ids
    batch = ids.shape[0]
    if any(_scalar(tensors, "stop", batch, b) for b in range(batch)):
        return True, []
    rows = []
    for b in range(batch):
        def get(name, default=None, b=b):
            value = _scalar(tensors, name, batch, b)
            return default if value is None else value

        length = get("input_lengths", ids.shape[1])
        if not 1 <= length <= ids.shape[1]:
            raise RequestError(f"input_lengths must be in [1, {ids.shape[1]}] (the tokens in input_ids), "
                               f"got {length}")
        prompt = ids[b, :length].tolist()
        decoder_ids = tensors.get("decoder_input_ids")
        if decoder_ids is not None:
            decoder_len = get("decoder_input_lengths", np.asarray(decoder_ids).reshape(batch, -1).shape[1])
            if decoder_len > 0:
                raise RequestError("decoder_input_ids is for encoder-decoder engines; this engine is decoder-only "
                                   f"(got {decoder_len} decoder tokens): send it empty or leave it out")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input_ids: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        max_tokens = get("request_output_len")
        if max_tokens is None or max_tokens < 1:
            raise RequestError(f"request_output_len must be >= 1, got {max_tokens}")
        beam_width = get("beam_width", 1)
        if not 1 <= beam_width <= max_beam_width:
            raise RequestError(f"beam_width must be in [1, {max_beam_width}] (the model's max_beam_width), "
                               f"got {beam_width}")
        if beam_width > 1 and get("beam_search_diversity_rate", 0.0) != 0:
            raise RequestError("beam_search_diversity_rate: diverse beam search is not supported; send 0")
        streaming = bool(get("streaming", False))
        if streaming and not decoupled:
            raise RequestError("streaming needs the decoupled model (decoupled_mode: true)")
        # With beams, the best num_return_sequences of them (all by default) in one response.
        n = get("num_return_sequences", beam_width if beam_width > 1 else 1)
        if n > 1 and beam_width == 1 and not decoupled:
            raise RequestError("num_return_sequences > 1 needs the decoupled model (decoupled_mode: true)")
        end_id = get("end_id")
        stop_words = word_list(tensors["stop_words_list"][b], "stop_words_list") \
            if tensors.get("stop_words_list") is not None else []
        bad_words = word_list(tensors["bad_words_list"][b], "bad_words_list") \
            if tensors.get("bad_words_list") is not None else []
        # end_id is the one end token (-1: none); without it, the engine's own EOS ids end a sequence.
        # A one-token stop word is a stop token, a longer one stops at its text; as in TensorRT-LLM,
        # the stop word stays in the output.
        if end_id is not None and end_id < 0:
            end_id = None
        stop_ids = ([] if end_id is None else [end_id]) + [w[0] for w in stop_words if len(w) == 1]
        stop_texts = [text for w in stop_words if len(w) > 1 and (text := tokenizer.decode(w))]
        try:
            sampling = sampling_fields(get("runtime_top_k"), get("runtime_top_p"), get("temperature"))
            params = SamplingParams(
                **sampling, n=n, max_tokens=max_tokens, min_tokens=get("min_tokens", get("min_length", 0)),
                seed=get("seed", get("random_seed")),
                repetition_penalty=get("repetition_penalty", 1.0), presence_penalty=get("presence_penalty", 0.0),
                frequency_penalty=get("frequency_penalty", 0.0), ignore_eos=get("end_id") is not None,
                stop_token_ids=stop_ids, stop=stop_texts, include_stop_str_in_output=True, bad_words_ids=bad_words,
                logprobs=0 if get("return_log_probs", False) else None,
                return_context_logits=bool(get("return_context_logits", False)),
                return_generation_logits=bool(get("return_generation_logits", False)),
                guided_decoding=guided_decoding(get("guided_decoding_guide_type"), get("guided_decoding_guide")),
                **beam_search(beam_width, get("len_penalty"), get("early_stopping")))
        except ValueError as e:
            raise RequestError(str(e)) from None
        rows.append(Row(prompt, params, streaming, bool(get("exclude_input_in_output", exclude_input_default)),
                        end_id, get("pad_id", end_id or 0),
                        bool(get("return_log_probs", False)), bool(get("return_perf_metrics", False)),
                        bool(get("return_num_input_tokens", False)), bool(get("return_num_output_tokens", False)),
                        *lora_inputs(tensors, batch, b)))
    return False, rows


def beam_search(beam_width: int, len_penalty, early_stopping) -> dict:
    """SamplingParams' beam search fields (TensorRT-LLM's early_stopping: true stops at beam_width
    finished beams, false by Hugging Face's heuristic); at width 1 the knobs have no effect there
    either."""
    if beam_width == 1:
        return {}
    return dict(use_beam_search=True, best_of=beam_width, length_penalty=1.0 if len_penalty is None else len_penalty,
                early_stopping=bool(early_stopping))


@dataclass
class SequenceStream:
    """What has been sent of one sequence."""
    sent: int = 0  # output tokens
    text: int = 0  # characters of the engine's detokenized text they made
    finished: bool = False


@dataclass
class Tracker:
    """Turns one row's RequestOutputs into response tensors (one dict per response)."""
    row: Row
    batch_index: int
    tokens_per_block: int
    vocab_size: int = 0  # generation_logits' width when a response has no rows
    streams: dict[int, SequenceStream] = field(default_factory=dict)
    last: RequestOutput | None = None  # the latest output seen

    def tokens(self, c: CompletionOutput) -> list[int]:
        """The sequence's output tokens without the end token that stopped it (end_id or the engine's
        EOS; a stop word stays)."""
        ids = c.token_ids
        if c.finish_reason == "stop" and ids and c.stop_reason in (None, self.row.end_id):
            return ids[:-1]
        return ids

    def update(self, out: RequestOutput) -> list[dict]:
        self.last = out
        if self.row.params.use_beam_search:
            return [self._beams(out)] if out.finished else []
        responses = []
        for c in out.outputs:
            s = self.streams.setdefault(c.index, SequenceStream())
            done = c.finish_reason is not None
            if s.finished or not (done or self.row.streaming):
                continue
            ids = self.tokens(c)
            # streaming: new tokens go out once they make text (a character may span tokens)
            if done or (len(ids) > s.sent and len(c.text) > s.text):
                start = s.sent if self.row.streaming else 0
                responses.append(self._tensors(out, c, ids, start, len(ids), s))
                s.sent, s.text, s.finished = len(ids), len(c.text), done
        return responses

    def _tensors(self, out: RequestOutput, c: CompletionOutput, ids: list[int], start: int, end: int,
                 s: SequenceStream) -> dict:
        row = self.row
        new = ids[start:end]
        output = new if row.streaming or row.exclude_input else out.prompt_token_ids + new

        def one(value, dtype):
            return np.array([[value]], dtype)

        before = (out.prompt_token_ids + ids[:start])[-PREFIX_CONTEXT:] if row.streaming else []
        t = {"output_ids": np.array([[output]], np.int32).reshape(1, 1, len(output)),
             "sequence_length": one(len(output), np.int32),
             "prefix_ids": np.array([[before]], np.int32).reshape(1, 1, len(before)),
             "batch_index": one(self.batch_index, np.int32), "sequence_index": one(c.index, np.int32)}
        if row.log_probs:
            lps = [lp[tok] for tok, lp in zip(new, c.logprobs[start:end])]
            t["cum_log_probs"] = one(c.cumulative_logprob, np.float32)
            t["output_log_probs"] = np.array([[lps]], np.float32).reshape(1, 1, len(lps))
        if c.generation_logits is not None:
            t["generation_logits"] = self._generation_logits(c.generation_logits[start:end])
        if out.context_logits is not None:
            t["context_logits"] = out.context_logits.numpy()[None]
        if row.num_input_tokens:
            t["num_input_tokens"] = one(len(out.prompt_token_ids), np.int32)
        if row.num_output_tokens:
            t["num_output_tokens"] = one(len(output), np.int32)
        if row.perf_metrics:
            t.update(perf_metrics(out, c, self.tokens_per_block))
        return t

    def _beams(self, out: RequestOutput) -> dict:
        """A beam search's one response: [1, beams, ...] tensors, best beam first, output_ids padded
        with pad_id."""
        beams = [self._tensors(out, c, ids, 0, len(ids), SequenceStream())
                 for c in out.outputs for ids in [self.tokens(c)]]
        t = merge(beams, self.row.pad_id)
        t = {k: v.reshape(1, len(beams), *v.shape[2:]) for k, v in t.items()
             if k not in ("batch_index", "sequence_index", "context_logits")}
        t["sequence_length"] = t["sequence_length"].reshape(1, len(beams))
        t["cum_log_probs"] = np.array([[c.cumulative_logprob for c in out.outputs]], np.float32)
        t["batch_index"] = np.array([[self.batch_index]], np.int32)
        t["sequence_index"] = np.array([[0]], np.int32)
        if out.context_logits is not None:
            t["context_logits"] = out.context_logits.numpy()[None]
        return t

    def _generation_logits(self, rows: list) -> np.ndarray:
        vocab = rows[0].shape[0] if rows else self.vocab_size
        logits = np.stack([r.numpy() for r in rows]) if rows else np.zeros((0, vocab), np.float32)
        if self.row.streaming:  # token before beam, as TensorRT-LLM streams them
            return logits.reshape(1, len(rows), 1, vocab)
        padded = np.zeros((self.row.params.max_tokens, vocab), np.float32)
        padded[:len(rows)] = logits
        return padded.reshape(1, 1, -1, vocab)


def perf_metrics(out: RequestOutput, c: CompletionOutput, tokens_per_block: int) -> dict:
    """return_perf_metrics' tensors, [1, 1] each."""
    m = out.metrics
    blocks = -(-(len(out.prompt_token_ids) + len(c.token_ids) - 1) // tokens_per_block)
    reused = (out.num_cached_tokens or 0) // tokens_per_block  # prefix cache hits are whole blocks

    def ns(t):
        return np.array([[int((t if t is not None else time.monotonic()) * 1e9)]], np.int64)

    return {"kv_cache_alloc_new_blocks": np.array([[blocks - reused]], np.int32),
            "kv_cache_reused_blocks": np.array([[reused]], np.int32),
            "kv_cache_alloc_total_blocks": np.array([[blocks]], np.int32),
            "arrival_time_ns": ns(m.arrival_time), "first_scheduled_time_ns": ns(m.first_scheduled_time),
            "first_token_time_ns": ns(m.first_token_time), "last_token_time_ns": ns(m.finished_time),
            # 0 unless the engine speculates (the Triton model takes no speculative_config yet)
            "acceptance_rate": np.array([[m.num_accepted_tokens / max(m.num_draft_tokens, 1)]], np.float32),
            "total_accepted_draft_tokens": np.array([[m.num_accepted_tokens]], np.int32),
            "total_draft_tokens": np.array([[m.num_draft_tokens]], np.int32)}


def merge(responses: list[dict], pad_id: int) -> dict:
    """Rows' responses as one (the non-decoupled model answers a request once): stacked along the
    batch, ragged dims padded (output_ids with pad_id, prefix_ids with -1, the rest with 0)."""
    out = {}
    for name in responses[0]:
        arrays = [r[name] for r in responses]
        shape = np.max([a.shape for a in arrays], axis=0)
        fill = {"output_ids": pad_id, "prefix_ids": -1}.get(name, 0)
        out[name] = np.concatenate([np.pad(a, [(0, m - d) for d, m in zip(a.shape, shape)], constant_values=fill)
                                    for a in arrays])
    return out
