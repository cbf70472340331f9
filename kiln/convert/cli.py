"""`convert_checkpoint`: HF model dir -> TensorRT-LLM unified checkpoint dir (same flag names)."""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path

import click

from kiln.config import DTYPES, ConfigError


def convert_checkpoint(
    model_dir: str | Path,
    output_dir: str | Path,
    dtype: str | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    progress: bool = False,
) -> Path:
    """Convert the HF model in `model_dir` into a checkpoint dir with tp_size * pp_size rank files.

    dtype defaults to the HF config's torch_dtype (float32 when it has none). Raises ConfigError
    (CheckpointError for weight problems) with a one-line message; on error nothing is left at
    output_dir (an existing checkpoint there is kept).
    """
    # torch/safetensors are imported here, not at module level, so `--help` stays fast.
    from tqdm import tqdm

    from kiln.convert.hf import HFWeights, pretrained_config_from_hf, read_hf_config
    from kiln.convert.shard import rank_plan, source_shapes
    from kiln.convert.writer import check_output_dir, write_checkpoint

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    hf = read_hf_config(model_dir)
    cfg = pretrained_config_from_hf(hf, dtype, tp_size, pp_size, where=model_dir / "config.json")
    check_output_dir(model_dir, output_dir)
    with HFWeights(model_dir) as weights:
        # Headers only: a missing tensor or wrong shape fails before anything is written.
        weights.check(source_shapes(cfg))
        plans = [rank_plan(cfg, rank) for rank in range(cfg.mapping.world_size)]
        with tqdm(total=sum(map(len, plans)), unit="tensor", desc="converting",
                  disable=not progress, file=sys.stderr, leave=False) as bar:
            write_checkpoint(cfg, weights, plans, model_dir, output_dir, on_tensor=bar.update)
    return output_dir


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def summary(architecture: str, output_dir: Path, seconds: float) -> str:
    files = sorted(Path(output_dir).glob("rank*.safetensors"))
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    return (f"converted {architecture} in {seconds:.1f}s: {len(files)} rank file(s), "
            f"{size_mb:.1f} MB, peak RSS {peak_rss_mb():.0f} MB -> {output_dir}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face model dir: config.json plus model.safetensors (or sharded "
                   "model-*.safetensors with model.safetensors.index.json). Pickle (.bin) weights "
                   "are refused.")
@click.option("--output_dir", required=True, type=click.Path(path_type=Path),
              help="Checkpoint dir to write: config.json, rank{N}.safetensors and the tokenizer "
                   "files. An existing checkpoint there is replaced only once the new one is complete.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None,
              help="Weight dtype of the checkpoint. Default: the HF config's torch_dtype, else float32.")
@click.option("--tp_size", type=int, default=1, show_default=True,
              help="Tensor-parallel size: attention heads, MLP and vocab are split across this many ranks.")
@click.option("--pp_size", type=int, default=1, show_default=True,
              help="Pipeline-parallel size: layers are split into this many consecutive stages.")
@click.pass_context
def main(ctx: click.Context, model_dir: Path, output_dir: Path, dtype: str | None,
         tp_size: int, pp_size: int) -> None:
    """Convert a Hugging Face Llama/Mistral/Qwen2/Qwen3 model into a TensorRT-LLM-style unified
    checkpoint with tp_size * pp_size rank files, ready for `engine-build`.

    \b
    Example:
      convert_checkpoint --model_dir ./Llama-3.2-1B --output_dir ./ckpt \\
          --dtype bfloat16 --tp_size 2
    """
    from kiln.config import read_json

    start = time.perf_counter()
    try:
        convert_checkpoint(model_dir, output_dir, dtype, tp_size, pp_size, progress=True)
        arch = read_json(output_dir / "config.json")["architecture"]
    except (ConfigError, OSError) as e:  # OSError: disk full, permissions - one line, no traceback
        click.echo(f"error: {e}", err=True)
        ctx.exit(1)
    click.echo(summary(arch, output_dir, time.perf_counter() - start))


if __name__ == "__main__":
    main()
