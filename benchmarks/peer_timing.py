"""What the peers timed by generating whole calls share (openvino_bench.py, ort_genai_bench.py): an
export done once per kind, and decode tokens/s as a generation less a prefill of the same batch, as
throughput.py times Kiln and HF."""
import shutil
import subprocess
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
