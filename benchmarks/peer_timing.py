"""What the peer runtimes' benchmarks share: an export done once per kind; decode tokens/s of the
peers timed by whole calls (openvino_bench.py, ort_genai_bench.py) as a generation less a prefill of
the same batch, as throughput.py times Kiln and HF; and `measure`, which times one peer model in a
process of its own.

A peer timed inside the benchmark's process shares it with Kiln's engines: their thread pools and
OpenMP teams stay alive after an engine is shut down, and libgomp, counting more threads than cores,
stops spinning in every team, so llama.cpp measured there ran 10-15% (and once 2.5x) slower than alone.
"""
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


def export_once(work: Path, kinds, done: str, command) -> dict[str, Path]:
    """{kind: work / kind}, each written by command(kind, out_dir) unless its `done` file is there: into a
    temporary dir renamed into place, so that a failed export leaves nothing to be taken for a model."""
    out = {}
    for kind in kinds:
        dest = work / kind
        if not (dest / done).is_file():
            tmp = work / f".{kind}.tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(command(kind, tmp), check=True, stdout=subprocess.DEVNULL)
            tmp.rename(dest)
        out[kind] = dest
    return out


class WholeCalls:
    """prefill and decode from generate(prompts, new_tokens) -> seconds of one call."""

    def generate(self, prompts: list[list[int]], new_tokens: int) -> float:
        raise NotImplementedError

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to prefill one prompt and sample its first token."""
        return self.generate([prompt], 1)

    def decode(self, prompts: list[list[int]], new_tokens: int) -> float:
        """Decode tokens/s of greedy generation of new_tokens for all prompts at once: the whole call less a
        prefill of the same batch (of the prompts reversed, so neither is served from a cache)."""
        self.generate([p[:0:-1] for p in prompts], 2)  # warm-up, at this batch size
        prefill = self.generate([p[::-1] for p in prompts], 1)
        total = self.generate(prompts, new_tokens)
        return len(prompts) * (new_tokens - 1) / max(total - prefill, 1e-9)


def measure(module: str, cls: str, path: Path, threads: int, decode: dict[int, list[list[list[int]]]],
            new_tokens: int, prefill: list[list[int]], max_len: int) -> dict:
    """{"decode": {batch: best tokens/s}, "prefill": best tokens/s} of module.cls's model at path, timed in a
    fresh interpreter: decode[batch] holds one batch of prompts per repeat, prefill one prompt per repeat."""
    job = {"module": module, "cls": cls, "path": str(Path(path).resolve()), "threads": threads,
           "new_tokens": new_tokens, "decode": {str(b): runs for b, runs in decode.items()}, "prefill": prefill,
           "max_len": max_len}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, str(out)], input=json.dumps(job), text=True, check=True,
                       cwd=Path(__file__).parent)
        r = json.loads(out.read_text())
    return {"decode": {int(b): v for b, v in r["decode"].items()}, "prefill": r["prefill"]}


def _measure_here(job: dict) -> dict:
    sys.path.insert(0, str(Path(__file__).parent))
    batches = [int(b) for b in job["decode"]]
    model = getattr(importlib.import_module(job["module"]), job["cls"])(
        Path(job["path"]), job["threads"], max(batches), job["max_len"])
    decode = {b: max(model.decode(p, job["new_tokens"]) for p in job["decode"][str(b)]) for b in batches}
    prefill = max(len(p) / model.prefill(p) for p in job["prefill"])
    model.close()
    return {"decode": decode, "prefill": prefill}


if __name__ == "__main__":
    Path(sys.argv[1]).write_text(json.dumps(_measure_here(json.loads(sys.stdin.read()))))
