"""ONNX Runtime GenAI on the same weights, for benchmarks/throughput.py --ort_genai.

The runtime goes in Kiln's venv (pip install onnxruntime-genai==0.18.0); its model builder runs in
the exporters' venv (--peer_python, see openvino_bench.py), which needs torch, transformers and onnx.

The HF model is built by `python -m onnxruntime_genai.models.builder -p int4|int8 -e cpu`: its CPU
defaults, int4 in blocks of 32 with int8 activations (accuracy level 4). The session runs
--threads intra-op threads. Generation is fed token ids, greedy, with min_length = max_length so
an EOS cannot end it early; decode tokens/s subtracts a prefill of the same batch (the prompt and
one token) from the whole generation, as throughput.py times Kiln and HF.
"""
import json
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np


def exported(hf_dir: Path, work: Path, python: str, kinds=("int4", "int8")) -> dict[str, Path]:
    """ORT GenAI model dirs of hf_dir per precision, built once into work."""
    out = {}
    for kind in kinds:
        dest = work / kind
        if not (dest / "genai_config.json").is_file():
            tmp = work / f".{kind}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run([python, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(tmp),
                            "-p", kind, "-e", "cpu", "-c", str(work / "cache")], check=True,
                           stdout=subprocess.DEVNULL)
            tmp.rename(dest)
        out[kind] = dest
    return out


class OrtGenai:
    def __init__(self, path: Path, threads: int, max_batch: int, max_len: int):
        import onnxruntime_genai as og

        self.og = og
        config = og.Config(str(path))
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
        self.model = og.Model(config)

    def _generate(self, prompts: list[list[int]], new_tokens: int) -> float:
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

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to prefill one prompt and sample its first token."""
        return self._generate([prompt], 1)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Decode tokens/s of greedy generation of new_tokens for all prompts at once: the whole call less a
        prefill of the same batch (of the prompts reversed, so neither is served from a cache)."""
        self._generate([p[:0:-1] for p in prompts], 2)  # warm-up, at this batch size
        prefill = self._generate([p[::-1] for p in prompts], 1)
        total = self._generate(prompts, new_tokens)
        return len(prompts) * (new_tokens - 1) / max(total - prefill, 1e-9)

    def close(self) -> None:
        del self.model
