"""llama.cpp on the same weights, for benchmarks/throughput.py --llama_cpp.

Needs llama-cpp-python built from source for this CPU, with the converter from the same sdist:

  pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps -d bench_out/llama_cpp
  CMAKE_ARGS="-DGGML_NATIVE=ON" pip install bench_out/llama_cpp/llama_cpp_python-0.3.36.tar.gz

On the AMX machine this was written on (a KVM guest of a Xeon with AMX), the native build's AMX-INT8
path died with SIGILL at its first tileloadd for q8_0 / q4_0 models; the native ISA without AMX
ran: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
-DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF".

The HF model is converted with the sdist's own vendor/llama.cpp/convert_hf_to_gguf.py (bf16, q8_0)
and quantized by llama.cpp's quantizer (llama_model_quantize: q4_0). Decode runs through the
low-level batch API (one llama_decode per step for all sequences, greedy argmax of each row, as
Kiln's benchmark samples greedily); prefill is one llama_decode of the whole prompt.
"""
import ctypes
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np

SDIST = "llama_cpp_python-0.3.36"


def converter(work: Path) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist (downloaded with pip into work if absent)."""
    src = work / SDIST / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    tarball = work / f"{SDIST}.tar.gz"
    if not tarball.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "llama-cpp-python==0.3.36", "--no-binary", ":all:",
                        "--no-deps", "-d", str(work)], check=True)
    prefix = f"{SDIST}/vendor/llama.cpp/"
    with tarfile.open(tarball) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix + "convert_hf_to_gguf.py")
                   or m.name.startswith(prefix + "gguf-py/") or m.name.startswith(prefix + "conversion/")]
        tar.extractall(work, members=members, filter="data")
    return src


# The converter run with LlamaModel's vocab written as a whitespace word list: the random benchmark
# model's tokenizer (t0 .. t{vocab-1}, split on spaces) is llama.cpp's "whitespace" vocab, which
# its HF-tokenizer detection does not guess. The benchmark feeds token ids, so only the ids matter.
CONVERT_WORD_LEVEL = (
    "import runpy, sys\n"
    "import conversion.base as base, conversion.llama as llama, conversion.qwen as qwen\n"
    "def set_vocab(self):\n"
    "    base.TextModel._set_vocab_whitespace(self)\n"
    "    self.gguf_writer.add_token_merges(['t1 t2'])  # llama.cpp's BPE loader insists on merges\n"
    "for module in (llama, qwen):  # Llama, Mixtral, Qwen3-MoE ...\n"
    "    for c in vars(module).values():\n"
    "        if isinstance(c, type) and issubclass(c, base.TextModel):\n"
    "            c.set_vocab = set_vocab\n"
    "base.TextModel.get_vocab_base_pre = lambda self, tokenizer: 'whitespace'\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n")


def _word_level(hf_dir: Path) -> bool:
    import json

    try:
        return json.loads((hf_dir / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"
    except (OSError, ValueError, KeyError):
        return False


def gguf_files(hf_dir: Path, work: Path, types=("bf16", "q8_0", "q4_0")) -> dict[str, Path]:
    """GGUF files of hf_dir per llama.cpp type, converted once into work."""
    import llama_cpp

    work.mkdir(parents=True, exist_ok=True)
    out = {t: work / f"model-{t}.gguf" for t in types}
    src = None
    for t in ("bf16", "q8_0"):
        if (t in types or (t == "bf16" and "q4_0" in types)) and not (work / f"model-{t}.gguf").is_file():
            src = src or converter(work)
            env = {**os.environ, "PYTHONPATH": f"{src / 'gguf-py'}{os.pathsep}{src}"}
            wrap = ["-c", CONVERT_WORD_LEVEL] if _word_level(hf_dir) else []
            subprocess.run([sys.executable, *wrap, str(src / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", t,
                            "--outfile", str(work / f"model-{t}.gguf")], check=True, env=env,
                           stdout=subprocess.DEVNULL)
    if "q4_0" in types and not out["q4_0"].is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
        params.nthread = os.cpu_count() or 1
        rc = llama_cpp.llama_model_quantize(str(work / "model-bf16.gguf").encode(), str(out["q4_0"]).encode(),
                                            ctypes.byref(params))
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to q4_0 failed ({rc})")
    return out


def exported(hf_dir: Path, work: Path, python: str) -> dict[str, Path]:
    """throughput.py's name for gguf_files (the converter runs in this interpreter, from the sdist)."""
    return gguf_files(hf_dir, work)


class LlamaCpp:
    """One GGUF model in a llama.cpp context sized for `max_batch` sequences of `max_len` tokens."""

    def __init__(self, path: Path, threads: int, max_batch: int, max_len: int):
        import llama_cpp as L

        self.L = L
        L.llama_backend_init()
        self._quiet = L.llama_log_callback(lambda *args: None)  # kept: llama.cpp calls it later
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        self.model = L.llama_model_load_from_file(str(path).encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        c = L.llama_context_default_params()
        c.n_ctx = max_batch * max_len
        c.n_batch = c.n_ubatch = max(512, max_batch)
        c.n_seq_max = max_batch
        c.n_threads = c.n_threads_batch = threads
        self.ctx = L.llama_init_from_model(self.model, c)
        self.n_batch = c.n_batch
        self.batch = L.llama_batch_init(self.n_batch, 0, max_batch)

    def _decode(self, tokens, positions, seqs, want_logits) -> None:
        L, b = self.L, self.batch
        for start in range(0, len(tokens), self.n_batch):
            end = min(len(tokens), start + self.n_batch)
            b.n_tokens = end - start
            for i in range(start, end):
                j = i - start
                b.token[j], b.pos[j], b.n_seq_id[j] = tokens[i], positions[i], 1
                b.seq_id[j][0] = seqs[i]
                b.logits[j] = want_logits[i]
            if L.llama_decode(self.ctx, b) != 0:
                raise RuntimeError("llama_decode failed")

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.L.llama_get_logits_ith(self.ctx, row), shape=(self.vocab,))
        return int(logits.argmax())

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to prefill one prompt (its last token's logits computed)."""
        self.clear()
        n = len(prompt)
        start = time.perf_counter()
        self._decode(prompt, list(range(n)), [0] * n, [i == n - 1 for i in range(n)])
        self._argmax((n - 1) % self.n_batch)
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Decode tokens/s of greedy generation of new_tokens for all prompts at once (prefill not counted);
        each step's seconds are left in self.step_times."""
        self.clear()
        flat = [(t, p, s) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt[:-1])]
        self._decode([f[0] for f in flat], [f[1] for f in flat], [f[2] for f in flat], [False] * len(flat))
        tokens, pos = [p[-1] for p in prompts], [len(p) - 1 for p in prompts]  # each step: one token per sequence
        self.step_times = []
        for _ in range(new_tokens):
            start = time.perf_counter()
            self._decode(tokens, pos, list(range(len(prompts))), [True] * len(prompts))
            tokens = [self._argmax(i) for i in range(len(prompts))]
            pos = [p + 1 for p in pos]
            self.step_times.append(time.perf_counter() - start)
        return len(prompts) * new_tokens / sum(self.step_times)

    def close(self) -> None:
        self.L.llama_batch_free(self.batch)
        self.L.llama_free(self.ctx)
        self.L.llama_model_free(self.model)
