"""engine-build: checkpoint dir -> engine dir (config.json, rank{N}.engine, tokenizer files)."""
import shutil
import tempfile
import time
from pathlib import Path

import torch

from kiln.build.ranks import build_ranks
from kiln.build.settings import resolve
from kiln.config import BuildConfig, ConfigError, EngineConfig, PretrainedConfig, read_json, write_json
from kiln.models.linear import check_quantization
from kiln.tokenizer_files import copy_tokenizer_files, has_tokenizer
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


def _record_tactics(build: BuildConfig, ranks: list, log, verbose: bool) -> None:
    """The GEMM tactics each rank timed (kiln/build/ranks.py) into build_config: the table, and the
    CPU features the chosen kernels need (checked when an engine loads on another CPU). Logged as the
    kernel chosen per GEMM and token range, or (verbose) every kernel's time per bucket."""
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
    chosen = tactics.format_table(table) if verbose else tactics.format_choices(table)
    log(f"GEMM kernels chosen, {torch.get_num_threads()} threads, {build.build_cpu}:\n{chosen}")
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


def _eagle3_draft(checkpoint_dir: Path, pretrained: PretrainedConfig, build: BuildConfig, log) -> Path | None:
    """A checkpoint with an EAGLE-3 draft (convert_checkpoint --eagle_model_dir) builds an engine that
    also returns the target layers' outputs the draft reads; the draft goes into the engine dir."""
    from kiln.models.eagle3 import DRAFT_DIR, check_target, draft_shape

    draft = checkpoint_dir / DRAFT_DIR
    if not draft.is_dir():
        if build.speculative_decoding_mode == "eagle3":
            raise ConfigError(f"--speculative_decoding_mode eagle3: checkpoint {checkpoint_dir} holds no EAGLE-3 "
                              f"draft; convert it with convert_checkpoint --eagle_model_dir DRAFT")
        return None
    shape = draft_shape(read_json(draft / "config.json"), pretrained.num_hidden_layers, draft)
    check_target(shape, pretrained, draft)
    build.speculative_decoding_mode, build.hidden_state_layers = "eagle3", shape.captured_layers
    log(f"EAGLE-3 draft {draft}: the engine returns the outputs of layers {shape.captured_layers} for it")
    return draft


def build_engine(checkpoint_dir, output_dir, build: BuildConfig, log=print, tokenizer_dir=None,
                 workers: int = 1, verbose: bool = False, dry_run: bool = False, lora_dirs=()) -> Path:
    """tokenizer_dir: where the tokenizer files come from (default: the checkpoint dir; ModelOpt's
    exports carry none, so their users pass the HF model dir, as TensorRT-LLM's do). workers: rank
    engines built at once, each in a process of its own (kiln/build/ranks.py). verbose: log every
    GEMM tactic's timings, not only the kernels chosen. dry_run: check, build nothing. lora_dirs:
    PEFT adapters the LoRA engine must take (kiln/build/settings.py)."""
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
    resolve(build, pretrained, log, lora_dirs)
    draft = _eagle3_draft(checkpoint_dir, pretrained, build, log)
    if dry_run:
        log(f"dry run: {checkpoint_dir} and every option check; nothing built or written ({output_dir})")
        return output_dir
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
        _record_tactics(build, ranks, log, verbose)
        build.c_shims = sorted({d for r in ranks for d in r.c_shims}) or None
        write_json(tmp / "config.json", EngineConfig(pretrained, build).to_dict())
        tokenizer_from = Path(tokenizer_dir or checkpoint_dir)
        copy_tokenizer_files(tokenizer_from, tmp)
        if draft is not None:
            shutil.copytree(draft, tmp / draft.name)
        tokenizer = (f"tokenizer from {tokenizer_from}" if has_tokenizer(tmp) else
                     f"no tokenizer (none in {tokenizer_from}; pass --tokenizer_dir <HF model dir>, or load "
                     f"the engine with skip_tokenizer_init and send token ids)")
        replace_dir(tmp, output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(f.stat().st_size for f in output_dir.rglob("*") if f.is_file()) / 2**20
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
