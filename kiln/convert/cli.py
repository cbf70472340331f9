"""`convert_checkpoint`: HF model dir -> TensorRT-LLM unified checkpoint dir (same flag names)."""
from __future__ import annotations

import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import click

from kiln.config import DTYPES, ConfigError
from kiln.convert import trtllm_flags
from kiln.convert.quantize.formats import AWQ_ALGORITHMS, DEFAULT_AWQ_ALGORITHM, KV_CACHE_DTYPES, QFORMATS

if TYPE_CHECKING:
    from kiln.convert.quantize.pipeline import QuantOptions


def convert_checkpoint(
    model_dir: str | Path,
    output_dir: str | Path,
    dtype: str | None = None,
    tp_size: int = 1,
    pp_size: int = 1,
    progress: bool = False,
    quant: "QuantOptions | None" = None,
    log: Callable[[str], object] | None = None,
    moe_tp_size: int | None = None,
    moe_ep_size: int | None = None,
    eagle_model_dir: str | Path | None = None,
) -> Path:
    """Convert the HF model in `model_dir` into a checkpoint dir with tp_size * pp_size rank files.
    eagle_model_dir: an EAGLE-3 draft for it, checked first and converted beside it
    (kiln/convert/eagle3.py).

    dtype defaults to the HF config's torch_dtype (float32 when it has none). `quant`
    (kiln.convert.quantize.pipeline.QuantOptions) quantizes weights and/or the KV cache and adds
    quant_report.json when there is text to evaluate on. Raises ConfigError (CheckpointError for
    weight problems) with a one-line message; on error nothing is left at output_dir (an existing
    checkpoint there is kept).
    """
    # torch/safetensors are imported here, not at module level, so `--help` stays fast.
    from kiln.convert.hf_config import pretrained_config_from_hf, read_hf_config

    model_dir, output_dir = Path(model_dir), Path(output_dir)
    hf = read_hf_config(model_dir)
    cfg = pretrained_config_from_hf(hf, dtype, tp_size, pp_size, model_dir / "config.json", moe_tp_size, moe_ep_size)
    if (moe_tp_size or moe_ep_size) and not cfg.moe.num_experts:
        raise ConfigError(f"--moe_tp_size / --moe_ep_size split a mixture of experts; {cfg.architecture} has none")
    if eagle_model_dir is None:
        return _convert(cfg, hf, model_dir, output_dir, quant, log, progress)
    from kiln.convert import eagle3

    draft = eagle3.read_draft(Path(eagle_model_dir), cfg, model_dir)
    _convert(cfg, hf, model_dir, output_dir, quant, log, progress)
    eagle3.write_draft(*draft, cfg.dtype, output_dir)
    return output_dir


def _convert(cfg, hf: dict, model_dir: Path, output_dir: Path, quant, log, progress: bool) -> Path:
    from tqdm import tqdm

    from kiln.convert.hf import HFWeights
    from kiln.convert.prequant import detect
    from kiln.convert.shard import fused_tensors, rank_plan, source_shapes
    from kiln.convert.writer import check_output_dir, write_checkpoint

    reader = detect(hf)
    if reader is not None:
        return _convert_prequantized(cfg, reader, quant, model_dir, output_dir, log or (lambda _: None))
    if quant is not None and quant.enabled:
        return _convert_quantized(cfg, quant, model_dir, output_dir, log or (lambda _: None))
    check_output_dir(model_dir, output_dir)
    with HFWeights(model_dir) as weights:
        weights.unfuse(fused_tensors(cfg))
        # Headers only: a missing tensor or wrong shape fails before anything is written.
        weights.check(source_shapes(cfg))
        plans = [rank_plan(cfg, rank) for rank in range(cfg.mapping.world_size)]
        with tqdm(total=sum(map(len, plans)), unit="tensor", desc="converting",
                  disable=not progress, file=sys.stderr, leave=False) as bar:
            write_checkpoint(cfg, weights, plans, model_dir, output_dir, on_tensor=bar.update)
    return output_dir


def _convert_quantized(cfg, quant, model_dir: Path, output_dir: Path, log) -> Path:
    from kiln.convert.hf import HFWeights
    from kiln.convert.quantize.pipeline import prepare, quantize, rank_tensors
    from kiln.convert.quantize.report import REPORT_FILE
    from kiln.convert.shard import fused_tensors, source_shapes
    from kiln.convert.writer import check_output_dir, write_ranks

    cfg, texts = prepare(cfg, quant)
    check_output_dir(model_dir, output_dir)
    with HFWeights(model_dir) as weights:
        weights.unfuse(fused_tensors(cfg))
        weights.check(source_shapes(cfg))
        tensors, report = quantize(cfg, quant, texts, weights, model_dir, log)
    ranks = (rank_tensors(cfg, tensors, r) for r in range(cfg.mapping.world_size))
    write_ranks(cfg, ranks, model_dir, output_dir, {REPORT_FILE: report} if report else None)
    return output_dir


def _convert_prequantized(cfg, reader, quant, model_dir: Path, output_dir: Path, log) -> Path:
    """A GPTQ/AWQ/compressed-tensors/ModelOpt/bitsandbytes checkpoint, read without re-quantizing."""
    from kiln.convert.hf import HFWeights
    from kiln.convert.prequant.convert import convert
    from kiln.convert.quantize.pipeline import rank_tensors
    from kiln.convert.writer import check_output_dir, write_ranks

    if quant is not None and quant.kv_cache_dtype:
        raise ConfigError(f"--kv_cache_dtype {quant.kv_cache_dtype} calibrates the unquantized model, which this "
                          f"checkpoint ({reader.describe()}) is not; build the engine with an unquantized KV cache")
    check_output_dir(model_dir, output_dir)
    with HFWeights(model_dir) as weights:
        outcome = convert(cfg, reader, weights, quant.qformat if quant else None, log)
    log(outcome.note)
    ranks = (rank_tensors(outcome.cfg, outcome.tensors, r) for r in range(outcome.cfg.mapping.world_size))
    write_ranks(outcome.cfg, ranks, model_dir, output_dir, {PREQUANT_FILE: {"source": reader.describe(),
                                                                            "conversion": outcome.note}})
    return output_dir


PREQUANT_FILE = "prequantized.json"  # what the checkpoint was read from, and how


def auto_dtype(model_dir: Path) -> str:
    """TensorRT-LLM's --dtype auto: the HF config's dtype, float32 turned float16."""
    from kiln.convert.hf_config import default_dtype, read_hf_config

    dtype = default_dtype(read_hf_config(Path(model_dir)))
    if dtype == "float32":
        click.echo("--dtype auto: the checkpoint is float32; converting to float16, as TensorRT-LLM does")
        return "float16"
    return dtype


def trtllm_options(f):
    for option in reversed(trtllm_flags.click_options()):
        f = option(f)
    return f


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 1e6 if sys.platform == "darwin" else peak * 1024 / 1e6


def summary(architecture: str, output_dir: Path, seconds: float, note: str = "") -> str:
    files = sorted(Path(output_dir).glob("rank*.safetensors"))
    size_mb = sum(f.stat().st_size for f in files) / 1e6
    return (f"converted {architecture} in {seconds:.1f}s: {len(files)} rank file(s), "
            f"{size_mb:.1f} MB, peak RSS {peak_rss_mb():.0f} MB{note} -> {output_dir}")


def _quant_note(quant, output_dir: Path) -> str:
    from kiln.config import read_json
    from kiln.convert.quantize.formats import FORMATS

    if quant is None or quant.qformat is None:
        return ""
    note = f", {quant.qformat}"
    if FORMATS[quant.qformat].group_wise:
        group = read_json(output_dir / "config.json")["quantization"]["group_size"]
        chosen = " (no --group_size: the largest supported dividing every linear's input size)"
        note += f", group size {group}{chosen if quant.group_size is None else ''}"
    return note


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--model_dir", required=True, type=click.Path(path_type=Path),
              help="Hugging Face model dir: config.json plus model.safetensors (or sharded "
                   "model-*.safetensors with model.safetensors.index.json). Pickle (.bin) weights "
                   "are refused.")
@click.option("--output_dir", required=True, type=click.Path(path_type=Path),
              help="Checkpoint dir to write: config.json, rank{N}.safetensors and the tokenizer "
                   "files. An existing checkpoint there is replaced only once the new one is complete.")
@click.option("--dtype", type=click.Choice(("auto", *DTYPES)), default=None,
              help="Weight dtype of the checkpoint. Default: the HF config's torch_dtype, else float32. auto "
                   "(TensorRT-LLM's): the HF config's, float32 turned float16.")
@click.option("--tp_size", type=int, default=1, show_default=True,
              help="Tensor-parallel size: attention heads, MLP and vocab are split across this many ranks.")
@click.option("--pp_size", type=int, default=1, show_default=True,
              help="Pipeline-parallel size: layers are split into this many consecutive stages.")
@click.option("--moe_tp_size", type=int, default=None, callback=lambda c, p, v: None if v == -1 else v,
              help="Mixtures of experts: ranks sharing each expert (its width split, as a dense MLP's). "
                   "moe_tp_size * moe_ep_size = tp_size; default tp_size (or tp_size / --moe_ep_size).")
@click.option("--moe_ep_size", type=int, default=None, callback=lambda c, p, v: None if v == -1 else v,
              help="Mixtures of experts: expert-parallel groups, each holding num_experts / moe_ep_size "
                   "whole experts. Default 1 (or tp_size / --moe_tp_size).")
@click.option("--qformat", type=click.Choice(QFORMATS), default=None,
              help="Quantize the weights of every linear (lm_head and embedding stay unquantized): "
                   "fp8 (FP8), int8_wo (W8A16), int4_wo (W4A16, round-to-nearest), int4_awq "
                   "(W4A16_AWQ), int4_gptq (W4A16_GPTQ), w4a8_awq (W4A8_AWQ), int8_sq "
                   "(W8A8_SQ_PER_CHANNEL). All but int8_wo/int4_wo calibrate with NVIDIA ModelOpt. A model "
                   "that is already quantized (GPTQ, AWQ, compressed-tensors, ModelOpt FP8) converts as it is, "
                   "without --qformat; a bitsandbytes one is dequantized, or re-quantized by int4_wo/int8_wo.")
@click.option("--awq_algorithm", type=click.Choice(tuple(AWQ_ALGORITHMS)), default=DEFAULT_AWQ_ALGORITHM,
              show_default=True,
              help="ModelOpt's AWQ search for --qformat int4_awq: clip (per weight group, the "
                   "clipping range with the least output error on the calibration text; no "
                   "pre-quant scale is written), lite (one per-input-channel scale per linear, "
                   "written as prequant_scaling_factor) or full (lite then clip, the AWQ paper's "
                   "method). On Kiln's default model only clip is clearly closer to the unquantized "
                   "model than int4_wo. w4a8_awq always uses lite.")
@click.option("--kv_cache_dtype", type=click.Choice(KV_CACHE_DTYPES), default=None,
              help="Quantize the KV cache (per-layer scales from calibration); with or without --qformat.")
@click.option("--group_size", type=int, default=None,
              help="Inputs per int4 scale (int4_* and w4a8_awq); must divide every linear's input size. "
                   "Default: the largest of 32, 64, 128, 256 that does (the summary says which).")
@click.option("--calib_dataset", type=click.Path(path_type=Path), multiple=True,
              help="Calibration text: a text file, a .jsonl file with a \"text\" field per line, or "
                   "a directory of such files (.txt, .py, .md, ...). Repeatable. Windows of it not "
                   "used for calibration are the accuracy report's text unless --eval_dataset is given.")
@click.option("--calib_size", type=int, default=512, show_default=True,
              help="Calibration samples (windows of --calib_max_seq_len tokens).")
@click.option("--calib_max_seq_len", "--calib_max_seq_length", type=int, default=512, show_default=True,
              help="Tokens per calibration sample and per evaluation window.")
@click.option("--eval_dataset", type=click.Path(path_type=Path), multiple=True,
              help="Held-out text for the accuracy report, in --calib_dataset's forms. Repeatable.")
@click.option("--eval_size", type=int, default=64, show_default=True,
              help="Evaluation windows for the accuracy report, spread over the text; 0: all.")
@click.option("--eagle_model_dir", type=click.Path(path_type=Path), default=None,
              help="An EAGLE-3 draft for the model (LlamaForCausalLMEagle3, as published): converted beside it, for "
                   "speculative_config {\"method\": \"eagle3\"} on the engine built from it.")
@trtllm_options
@click.pass_context
def main(ctx: click.Context, model_dir: Path, output_dir: Path, dtype: str | None,
         tp_size: int, pp_size: int, moe_tp_size: int | None, moe_ep_size: int | None, qformat: str | None,
         awq_algorithm: str, kv_cache_dtype: str | None,
         group_size: int | None, calib_dataset: tuple[Path, ...], calib_size: int, calib_max_seq_len: int,
         eval_dataset: tuple[Path, ...], eval_size: int, eagle_model_dir: Path | None, **trtllm) -> None:
    """Convert a Hugging Face Llama/Mistral/Qwen2/Qwen3 or Mixtral/Qwen2-MoE/Qwen3-MoE model into a
    TensorRT-LLM-style unified checkpoint with tp_size * pp_size rank files, ready for `engine-build`,
    optionally quantized.

    TensorRT-LLM's convert_checkpoint.py options are taken with its meaning: --use_fp8, --use_weight_only
    --weight_only_precision int8|int4|int4_awq|int4_gptq, --smoothquant ALPHA [--per_channel],
    --int8_kv_cache, --fp8_kv_cache, --dtype auto, ... (calibrating on Python's standard library where
    no --calib_dataset is given); those Kiln's converter does not need are accepted and said in one line.

    \b
    Examples:
      convert_checkpoint --model_dir ./Llama-3.2-1B --output_dir ./ckpt \\
          --dtype bfloat16 --tp_size 2
      convert_checkpoint --model_dir ./Llama-3.2-1B --output_dir ./ckpt-awq \\
          --qformat int4_awq --kv_cache_dtype fp8 --calib_dataset ./texts/
    """
    from kiln.config import read_json

    start = time.perf_counter()
    quant = None
    try:
        quiet = trtllm.pop("log_level") in ("warning", "error", "internal_error")
        for line in trtllm_flags.notes(trtllm):
            click.echo(line)
        theirs = trtllm_flags.quantization(trtllm)
        alpha = None
        if theirs is not None:
            for line in theirs.notes:
                click.echo(line)
            if qformat and theirs.qformat not in (None, qformat) or kv_cache_dtype and theirs.kv_cache_dtype not in (
                    None, kv_cache_dtype):
                raise ConfigError(f"--qformat/--kv_cache_dtype ({qformat}, {kv_cache_dtype}) and TensorRT-LLM's flags "
                                  f"({theirs.qformat}, {theirs.kv_cache_dtype}) ask for different quantizations")
            qformat, kv_cache_dtype = qformat or theirs.qformat, kv_cache_dtype or theirs.kv_cache_dtype
            alpha = theirs.smoothquant_alpha
        if dtype == "auto":
            dtype = auto_dtype(model_dir)
        if qformat or kv_cache_dtype:
            from kiln.convert.quantize.pipeline import QuantOptions

            quant = QuantOptions(qformat, kv_cache_dtype, group_size, list(calib_dataset) or None,
                                 calib_size, calib_max_seq_len, list(eval_dataset) or None, eval_size,
                                 awq_algorithm, alpha, default_calibration=theirs is not None and
                                 theirs.default_calibration)
            if quant.default_calibration and quant.calibrated and not calib_dataset:
                from kiln.convert.quantize.calib import DEFAULT_PACKAGES

                click.echo(f"no --calib_dataset: calibrating on Python's standard library ({', '.join(DEFAULT_PACKAGES)}), "
                           f"where TensorRT-LLM downloads cnn_dailymail")
        convert_checkpoint(model_dir, output_dir, dtype, tp_size, pp_size, progress=not quiet, quant=quant,
                           log=lambda msg: quiet or click.echo(msg, err=True), moe_tp_size=moe_tp_size,
                           moe_ep_size=moe_ep_size, eagle_model_dir=eagle_model_dir)
        arch = read_json(output_dir / "config.json")["architecture"]
    except (ConfigError, OSError) as e:  # OSError: disk full, permissions - one line, no traceback
        click.echo(f"error: {e}", err=True)
        ctx.exit(1)
    if quiet:
        return
    if quant is not None and not (output_dir / PREQUANT_FILE).is_file():  # pre-quantized: said as it converted
        _echo_report(output_dir)
    click.echo(summary(arch, output_dir, time.perf_counter() - start, _quant_note(quant, output_dir)))


def _echo_report(output_dir: Path) -> None:
    import json

    from kiln.convert.quantize.report import REPORT_FILE, summary_lines

    path = output_dir / REPORT_FILE
    if path.is_file():
        for line in summary_lines(json.loads(path.read_text())):
            click.echo(line)
    else:
        click.echo("no accuracy report: pass --calib_dataset or --eval_dataset to get one")


if __name__ == "__main__":
    main()
