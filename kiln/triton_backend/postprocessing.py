"""The `postprocessing` model: TOKENS_BATCH / SEQUENCE_LENGTH to text. A streamed chunk comes with
PREFIX_IDS (the tokens before it) and is decoded in their context, so that chunks join into the
same text as one decode of the whole output (spaces kept, no broken UTF-8)."""
import json

import numpy as np
import triton_python_backend_utils as pb_utils

from kiln.triton_backend import parameters
from kiln.triton_backend.text import decode


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        try:
            p = parameters.read(config.get("parameters", {}), ["tokenizer_dir", "skip_special_tokens"])
        except parameters.ParamError as e:
            raise pb_utils.TritonModelException(f"postprocessing: {e}") from None
        self.skip_special_tokens = p["skip_special_tokens"]
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(p["tokenizer_dir"])

    def execute(self, requests):
        responses = []
        for request in requests:
            t = {x.name(): x.as_numpy() for x in request.inputs()}
            tokens = np.asarray(t["TOKENS_BATCH"])
            lengths = np.asarray(t["SEQUENCE_LENGTH"]).reshape(tokens.shape[:2])
            prefix = np.asarray(t["PREFIX_IDS"]) if "PREFIX_IDS" in t else None
            # one string per (row, sequence), flat: TensorRT-LLM's clients read text_output[0]
            texts = [decode(self.tokenizer, tokens[b, i, :lengths[b, i]].tolist(),
                            [] if prefix is None else [x for x in prefix[b, i].tolist() if x >= 0],
                            self.skip_special_tokens).encode("utf-8")
                     for b in range(tokens.shape[0]) for i in range(tokens.shape[1])]
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT", np.array(texts, dtype=object))]))
        return responses
