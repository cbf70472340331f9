"""OpenVINO GenAI on the same weights, for benchmarks/throughput.py --openvino.

The runtime goes in Kiln's venv; the exporter (optimum-intel) in a venv of its own, because it
pulls a newer torch than Kiln's pin, and throughput.py runs it there (--peer_python):

  pip install openvino-genai==2026.4.1.0
  python -m venv bench_out/peers && bench_out/peers/bin/pip install torch==2.13.0 'transformers==5.5.*' \
      'optimum-intel[openvino]==2.2.0' onnxruntime-genai==0.18.0 onnx onnx-ir
  bench_out/peers/bin/pip uninstall -y torchvision

transformers 5.5: optimum-intel 2.2 takes < 5.6 and onnxruntime-genai's builder imports 5.x's Qwen3.5
classes. optimum-intel pulls a torchvision built for another torch, which then fails every import of
transformers' models ("operator torchvision::nms does not exist"): nothing here needs it.

The HF model is exported by `optimum-cli export openvino` at fp16, int8 and int4 (symmetric,
group 64, every layer: --ratio 1.0). Batch-1 decode and prefill run on LLMPipeline, larger batches
on ContinuousBatchingPipeline, the prefix cache off, both fed token ids (no tokenizer), greedy, EOS
ignored. Decode tokens/s subtracts a prefill of the same batch (max_new_tokens=1) from the whole
generation, as throughput.py times Kiln and HF.
"""
import time
from pathlib import Path

import numpy as np

from peer_timing import WholeCalls, export_once

WEIGHT_FORMATS = {"fp16": ["--weight-format", "fp16"], "int8": ["--weight-format", "int8"],
                  "int4": ["--weight-format", "int4", "--sym", "--group-size", "64", "--ratio", "1.0"]}


def exported(hf_dir: Path, work: Path, python: str, kinds=tuple(WEIGHT_FORMATS)) -> dict[str, Path]:
    """OpenVINO IR dirs of hf_dir per weight format, exported once into work."""
    return export_once(work, kinds, "openvino_model.xml", lambda kind, out: [
        python, "-m", "optimum.commands.optimum_cli", "export", "openvino", "--model", str(hf_dir),
        "--task", "text-generation-with-past", *WEIGHT_FORMATS[kind], str(out)])


class OpenVino(WholeCalls):
    """One exported model: an LLMPipeline for batch 1 and a ContinuousBatchingPipeline for batches."""

    def __init__(self, path: Path, threads: int, max_batch: int, max_len: int):
        import openvino_genai as ov_genai

        self.g = ov_genai
        properties = {"INFERENCE_NUM_THREADS": threads}
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        scheduler.max_num_seqs = max_batch
        scheduler.max_num_batched_tokens = max(max_batch * max_len, 2048)
        scheduler.cache_size = 1  # GB of KV cache
        self.pipe = ov_genai.LLMPipeline(str(path), "CPU", scheduler_config=scheduler, **properties)
        self.batched = ov_genai.ContinuousBatchingPipeline(str(path), scheduler, "CPU", properties)

    def _config(self, new_tokens: int):
        c = self.g.GenerationConfig()
        c.max_new_tokens = c.min_new_tokens = new_tokens
        c.ignore_eos = True
        c.do_sample = False
        return c

    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        import openvino as ov

        start = time.perf_counter()
        if len(prompts) == 1:
            ids = np.array(prompts, dtype=np.int64)
            out = self.pipe.generate(self.g.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))),
                                     self._config(new_tokens))
            counts = [len(t) for t in out.tokens]
        else:
            outs = self.batched.generate([ov.Tensor(np.array([p], dtype=np.int64)) for p in prompts],
                                         [self._config(new_tokens)] * len(prompts))
            counts = [len(o.m_generation_ids[0]) for o in outs]
        seconds = time.perf_counter() - start
        if counts != [new_tokens] * len(prompts):
            raise RuntimeError(f"OpenVINO generated {counts} tokens, expected {new_tokens} each")
        return seconds

    def close(self) -> None:
        del self.pipe, self.batched
