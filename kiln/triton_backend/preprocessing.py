"""The `preprocessing` model: text_input, stop and bad words to token ids (tensorrtllm_backend's
tensor names), with the engine's tokenizer."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from kiln.triton_backend import parameters
from kiln.triton_backend.text import text_of, word_lists

REFUSED = {"EMBEDDING_BIAS_WORDS": "embedding_bias_words", "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights"}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        try:
            p = parameters.read(config.get("parameters", {}), ["tokenizer_dir", "add_special_tokens"])
        except parameters.ParamError as e:
            raise pb_utils.TritonModelException(f"preprocessing: {e}") from None
        self.add_special_tokens = p["add_special_tokens"]
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(p["tokenizer_dir"])
        tok = self.tokenizer
        self.end_id = tok.eos_token_id if tok.eos_token_id is not None else 0
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else self.end_id

    def execute(self, requests):
        responses = []
        for request in requests:
            tensors = {t.name(): t.as_numpy() for t in request.inputs()}
            try:
                responses.append(pb_utils.InferenceResponse(
                    [pb_utils.Tensor(k, v) for k, v in self.preprocess(tensors).items()]))
            except ValueError as e:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e))))
        return responses

    def preprocess(self, t: dict) -> dict:
        for name, public in REFUSED.items():
            if name in t:
                raise ValueError(f"input {public}: embedding bias is not supported yet; send the request without it")
        queries = [text_of(q) for q in np.asarray(t["QUERY"]).reshape(-1)]
        batch = len(queries)
        out_len = np.asarray(t["REQUEST_OUTPUT_LEN"]).reshape(batch, -1)[:, :1].astype(np.int32)
        if (out_len < 1).any():
            raise ValueError(f"max_tokens (REQUEST_OUTPUT_LEN) must be >= 1, got {int(out_len.min())}")
        ids = [self.tokenizer.encode(q, add_special_tokens=self.add_special_tokens) for q in queries]
        if not all(ids):
            raise ValueError("text_input is empty: it has no tokens")
        end_id = self._per_row(t, "END_ID", self.end_id, batch)
        pad_id = self._per_row(t, "PAD_ID", self.pad_id, batch)
        width = max(len(i) for i in ids)
        input_ids = np.array([i + [int(pad_id[b, 0])] * (width - len(i)) for b, i in enumerate(ids)], np.int32)
        empty = [[]] * batch
        # The decoder's prompt, for encoder-decoder engines; a decoder-only one gets it empty (and
        # tensorrt_llm refuses it when it is not)
        decoder = [self.tokenizer.encode(text_of(q), add_special_tokens=self.add_special_tokens)
                   for q in np.asarray(t["DECODER_QUERY"]).reshape(-1)] if "DECODER_QUERY" in t else [[]] * batch
        decoder_width = max(len(d) for d in decoder)
        return {"INPUT_ID": input_ids, "REQUEST_INPUT_LEN": np.array([[len(i)] for i in ids], np.int32),
                "REQUEST_OUTPUT_LEN": out_len,
                "BAD_WORDS_IDS": word_lists(t.get("BAD_WORDS_DICT", empty), self.tokenizer),
                "STOP_WORDS_IDS": word_lists(t.get("STOP_WORDS_DICT", empty), self.tokenizer),
                "OUT_END_ID": end_id, "OUT_PAD_ID": pad_id,
                "DECODER_INPUT_ID": np.array([d + [int(pad_id[b, 0])] * (decoder_width - len(d))
                                              for b, d in enumerate(decoder)], np.int32).reshape(batch, decoder_width),
                "REQUEST_DECODER_INPUT_LEN": np.array([[len(d)] for d in decoder], np.int32)}

    @staticmethod
    def _per_row(t: dict, name: str, default: int, batch: int) -> np.ndarray:
        if name not in t:
            return np.full((batch, 1), default, np.int32)
        return np.asarray(t[name]).reshape(batch, -1)[:, :1].astype(np.int32)
