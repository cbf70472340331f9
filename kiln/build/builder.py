"""engine-build: checkpoint dir -> engine dir (config.json, rank{N}.engine, tokenizer files)."""
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kiln.build.ranks import build_ranks
from kiln.engine.format import kv_cache_dtype
from kiln.convert.writer import copy_tokenizer_files, has_tokenizer
from kiln.config import (ELEMENTWISE_PLUGINS, BuildConfig, ConfigError, EngineConfig, PretrainedConfig, read_json,
                         write_json)
from kiln.models.linear import INT4_ALGOS, check_quantization
from kiln.utils import peak_rss_mb, replace_dir, progress


def check_output_dir(checkpoint_dir: Path, output_dir: Path) -> None:
    """A successful build replaces output_dir wholesale: refuse dirs that are not engine dirs."""
    out = output_dir.resolve()
    if out == checkpoint_dir.resolve() or out in checkpoint_dir.resolve().parents:
        raise ConfigError(f"output dir {output_dir} would replace the checkpoint dir {checkpoint_dir}; "
                          f"choose another output dir")
    if output_dir.exists():
        if not output_dir.is_dir():
            raise ConfigError(f"output dir {output_dir} exists and is not a directory")
        if any(output_dir.iterdir()):
            try:
                is_engine = "build_config" in read_json(output_dir / "config.json")
            except (ConfigError, TypeError):
                is_engine = False
            if not is_engine:
                raise ConfigError(f"output dir {output_dir} exists and is not an engine dir (no config.json "
                                  f"with build_config); remove it or choose another output dir")


def _record_tactics(build: BuildConfig, ranks: list, log) -> None:
    """The GEMM tactics each rank timed (kiln/build/ranks.py) into build_config: the table, and the
    CPU features the chosen kernels need (checked when an engine loads on another CPU)."""
    from kiln.plugins import tactics

    tables = [r.gemm_tactics for r in ranks if r.gemm_tactics]
    if not tables:
        return
    table = {}
    for t in tables:  # ranks of one mapping share their GEMM shapes: the first rank's row per shape
        for key, entry in t.items():
            table.setdefault(key, entry)
    build.gemm_tactics = table
    build.cpu_features = sorted(set().union(*(tactics.features_needed(tactics.kernels_of(t)) for t in tables)))
    build.build_cpu = f"{tactics.cpu_model()} ({','.join(tactics.cpu_features())})"
    log(f"GEMM tactics, {torch.get_num_threads()} threads, {build.build_cpu}:\n{tactics.format_table(table)}")
    log(f"timed GEMM tactics in {sum(r.tactic_seconds for r in ranks):.1f}s ({sum(r.tactics_measured for r in ranks)} "
        f"measured, {sum(r.tactics_cached for r in ranks)} from the timing cache); the engine's kernels need: "
        f"{', '.join(build.cpu_features) or 'nothing beyond x86-64'}")
    loads = [r.timing_load for r in ranks if r.timing_load]
    if loads:
        known = [x["other_cpus"] for x in loads if x["other_cpus"] is not None]
        other = max(known) if known else None
        build.tactic_timing_load = {"other_cpus": other, "load_average": max(x["load_average"] for x in loads),
                                    "buckets": sum(x["buckets"] for x in loads),
                                    "retimed": sum(x["retimed"] for x in loads)}
        t = build.tactic_timing_load
        summary = (f"machine load while timing: other processes took "
                   f"{'?' if other is None else f'{other:.2f}'} CPUs on average (load average {t['load_average']:.1f}); "
                   f"{t['retimed']} of {t['buckets']} buckets timed again for noise")
        if (other or 0) > tactics.LOADED_CPUS or t["retimed"] > 0.1 * max(t["buckets"], 1):
            summary += ("\nwarning: the GEMM tactics were timed on a busy machine and may be noise; rebuild on a "
                        "quiet one, or pass --timing_cache with a cache timed on one")
        log(summary)


LM_HEAD_QUANTIZATIONS = ("none", "int8", "int4")
# Checkpoints whose linears are int8 or int4 weights with float activations.
WEIGHT_ONLY_ALGOS = ("W8A16", "W4A16", "W4A16_AWQ", "W4A16_GPTQ")


def lm_head_quantization(value, pretrained: PretrainedConfig, gemm_plugin: str) -> str:
    """--quantize_lm_head resolved: "none", "int8" or "int4".

    The default quantizes the lm_head of int8/int4 weight-only checkpoints to int8 per row: at
    SmolLM-135M's shape the bf16 lm_head is about half of an int4 engine's bytes, so batch-1 decode
    reads it more than all the layers together, and on the default model the int8 lm_head moved
    engine perplexity by 0.00% (int4 per group: +1%; benchmarks/quant.py --quantize_lm_head). FP8,
    SmoothQuant and unquantized checkpoints keep it as it is, as ModelOpt does."""
    algo = pretrained.quantization.quant_algo
    if value is None or value == "auto":
        return "int8" if gemm_plugin == "cpp" and algo in WEIGHT_ONLY_ALGOS else "none"
    if isinstance(value, bool):  # an engine config written before: the checkpoint's width
        value = ("int4" if algo in INT4_ALGOS else "int8") if value else "none"
    if value not in LM_HEAD_QUANTIZATIONS:
        raise ConfigError(f"quantize_lm_head {value!r} is not supported; expected auto or one of "
                          f"{', '.join(LM_HEAD_QUANTIZATIONS)}")
    if value != "none" and gemm_plugin != "cpp":
        raise ConfigError("--quantize_lm_head needs the C++ GEMM plugin (--gemm_plugin cpp, an aoti build's default "
                          "for bf16/fp16 or quantized weights)")
    return value


def build_engine(checkpoint_dir, output_dir, build: BuildConfig, log=print, tokenizer_dir=None,
                 workers: int = 1) -> Path:
    """tokenizer_dir: where the tokenizer files come from (default: the checkpoint dir; ModelOpt's
    exports carry none, so their users pass the HF model dir, as TensorRT-LLM's do). workers: rank
    engines built at once, each in a process of its own (kiln/build/ranks.py)."""
    start = time.time()
    checkpoint_dir, output_dir = Path(checkpoint_dir), Path(output_dir)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise ConfigError(f"tokenizer dir {tokenizer_dir} not found")
    check_output_dir(checkpoint_dir, output_dir)
    pretrained = PretrainedConfig.load(checkpoint_dir)
    try:
        check_quantization(pretrained)
    except ConfigError as e:
        raise ConfigError(f"{checkpoint_dir / 'config.json'}: {e}") from None
    if build.lora_config is not None:
        from kiln.models.lora import check_lora_config

        check_lora_config(build.lora_config, pretrained)
    kv_algo = pretrained.quantization.kv_cache_quant_algo
    if build.plugin_config.get("gpt_attention_plugin") is None:
        # Measured (benchmarks/step_profile.py, SmolLM-135M shape, bf16): the C++ plugin's decode step
        # at batch 16 takes 0.64x the time of attention traced inline, and the build half the time.
        build.plugin_config["gpt_attention_plugin"] = "cpp" if build.backend == "aoti" else "inline"
    if kv_algo:
        real = str(kv_cache_dtype(pretrained, build)).removeprefix("torch.")
        if build.kv_cache_dtype not in (None, real):
            raise ConfigError(f"kv_cache_dtype {build.kv_cache_dtype!r} contradicts the checkpoint's "
                              f"kv_cache_quant_algo {kv_algo} ({real})")
        build.kv_cache_dtype = real
    if build.plugin_config.get("gemm_plugin") is None:
        # Measured (benchmarks/throughput.py, SmolLM-135M shape, bf16, against autotuned Inductor
        # GEMMs, on a noisy shared machine): batch-1 decode 1.1-1.3x, batch 16 and 64 1.2-1.8x,
        # prefill 1.1-2.1x, build 0.6x the time, engine half the size. float32 keeps ATen's GEMMs: MKL's sgemm has no weights to decode, and float32
        # engines are the HF-parity reference.
        use_cpp = build.backend == "aoti" and (pretrained.dtype != "float32" or bool(pretrained.quantization.quant_algo))
        build.plugin_config["gemm_plugin"] = "cpp" if use_cpp else "inline"
    serial = build.plugin_config["gemm_plugin"] == "cpp" and build.plugin_config["gpt_attention_plugin"] == "cpp"
    for key in ELEMENTWISE_PLUGINS:
        if build.plugin_config.get(key) is None:
            # Where the step's compiled loops run on one thread (kiln/engine/loader.py), the norms,
            # rope and SwiGLU run on the kernels' pool instead: a 512-token prefill otherwise spends
            # its elementwise work on one core.
            build.plugin_config[key] = "cpp" if serial else "inline"
    if build.max_autotune is None:
        # Measured on CPU: autotuned micro-GEMMs run bf16 2-3x faster than ATen's; fp32 gains little
        # for a much longer build. With the GEMM plugin no GEMM is left for Inductor to tune.
        build.max_autotune = (build.backend == "aoti" and pretrained.dtype != "float32"
                              and build.plugin_config["gemm_plugin"] != "cpp")
    if pretrained.mapping.tp_size > 1:
        # TensorRT-LLM's name for its collectives plugin: the graph calls kiln_cpp::all_reduce/all_gather.
        build.plugin_config["nccl_plugin"] = "cpp"
    build.quantize_lm_head = lm_head_quantization(build.quantize_lm_head, pretrained,
                                                  build.plugin_config["gemm_plugin"])
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.", dir=output_dir.parent))
    try:
        world = pretrained.mapping.world_size
        with progress(total=world, desc="ranks", disable=workers == 1 or world == 1) as bar:
            def built(r):
                bar.update(1)
                if world > 1:
                    log(f"rank {r.rank}: built in {r.seconds:.1f}s, peak RSS {r.peak_rss_mb:.0f} MB")

            ranks = build_ranks(checkpoint_dir, pretrained, build, tmp, workers, built)
        _record_tactics(build, ranks, log)
        build.c_shims = sorted({d for r in ranks for d in r.c_shims}) or None
        write_json(tmp / "config.json", EngineConfig(pretrained, build).to_dict())
        tokenizer_from = Path(tokenizer_dir or checkpoint_dir)
        copy_tokenizer_files(tokenizer_from, tmp)
        tokenizer = (f"tokenizer from {tokenizer_from}" if has_tokenizer(tmp) else
                     f"no tokenizer (none in {tokenizer_from}; pass --tokenizer_dir <HF model dir>, or load "
                     f"the engine with skip_tokenizer_init and send token ids)")
        replace_dir(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in output_dir.iterdir()) / 2**20
    moe = ""
    if pretrained.moe.num_experts:
        total, active = pretrained.parameter_counts()
        moe = (f"{pretrained.moe.num_experts} experts (top {pretrained.moe.top_k}), {active / 1e6:.1f}M of "
               f"{total / 1e6:.1f}M parameters active per token, ")
    log(f"built {build.backend} engine in {time.time() - start:.1f}s: "
        f"{pretrained.mapping.world_size} rank(s), {size:.1f} MB, {moe}peak RSS {peak_rss_mb():.0f} MB, "
        f"{'' if build.quantize_lm_head == 'none' else f'{build.quantize_lm_head} lm_head, '}{tokenizer} "
        f"-> {output_dir}")
    return output_dir
