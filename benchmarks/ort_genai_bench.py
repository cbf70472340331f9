"""ONNX Runtime GenAI on the same weights, for benchmarks/throughput.py --ort_genai.

The runtime goes in Kiln's venv (pip install onnxruntime-genai==0.18.0); its model builder runs in
the exporters' venv (--peer_python, see openvino_bench.py), which needs torch, transformers and onnx.

The HF model is built by `python -m onnxruntime_genai.models.builder -p int4|int8 -e cpu`: its CPU
defaults, int4 in blocks of 32 with int8 activations (accuracy level 4). The session runs
--threads intra-op threads. Generation is fed token ids, greedy, with min_length = max_length so
an EOS cannot end it early; decode tokens/s subtracts a prefill of the same batch (the prompt and
one token) from the whole generation (peer_timing.py).
"""
import json
import time
from pathlib import Path

import numpy as np

from peer_timing import WholeCalls, export_once


def exported(hf_dir: Path, work: Path, python: str, kinds=("int4", "int8")) -> dict[str, Path]:
    """ORT GenAI model dirs of hf_dir per precision, built once into work."""
    return export_once(work, kinds, "genai_config.json", lambda kind, out: [
        python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out), "-p", kind, "-e", "cpu",
        "-c", str(work / "cache")])


class OrtGenai(WholeCalls):
    def __init__(self, path: Path, threads: int, max_batch: int, max_len: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(path))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        params = self.og.GeneratorParams(self.model)
        length = len(prompts[0]) + new_tokens
        params.set_search_options(do_sample=False, max_length=length, min_length=length, batch_size=len(prompts))
        start = time.perf_counter()
        generator = self.og.Generator(self.model, params)
        generator.append_tokens(np.array(prompts, dtype=np.int32))
        steps = 0
        while not generator.is_done():
            generator.generate_next_token()
            steps += 1
        seconds = time.perf_counter() - start
        if steps != new_tokens:
            raise RuntimeError(f"ORT GenAI generated {steps} tokens, expected {new_tokens}")
        return seconds

    def close(self) -> None:
        del self.model
