"""Building each rank engine of a checkpoint's mapping, in this process or in parallel processes.

A rank's build reads only its own checkpoint file (rank{N}.safetensors), so a build process holds
one rank's weights, never the whole model. With workers > 1 each rank is built in a fresh process
of its own (`python -m kiln.build.ranks`), at most `workers` at once, and reports its own build time
and peak RSS.
"""
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from kiln.build import backends
from kiln.build.export import export
from kiln.build.weights import load_rank_weights
from kiln.config import BuildConfig, ConfigError, PretrainedConfig, torch_dtype
from kiln.models.linear import PackedLinear
from kiln.models.llama import LlamaForCausalLM
from kiln.models.ops.op_set import OpSet
from kiln.plugins import tactics
from kiln.threads import available_cpus
from kiln.utils import child_env, progress


@dataclass
class RankBuild:
    rank: int
    seconds: float
    peak_rss_mb: float  # of the process that built it (with workers == 1: every rank built so far)
    gemm_tactics: dict = field(default_factory=dict)  # kiln.plugins.tactics.select's table, if timed
    tactic_seconds: float = 0.0
    tactics_measured: int = 0  # GEMM timings run, and those the timing cache had
    tactics_cached: int = 0
    timing_load: dict | None = None  # tactics.MachineLoad's figures while they were timed
    c_shims: list = field(default_factory=list)  # the C shims the engine calls (kiln.plugins.c_shims)


def build_rank(checkpoint_dir: Path, pretrained: PretrainedConfig, build: BuildConfig, rank: int,
               path: Path, show_progress: bool = True) -> RankBuild:
    start = time.time()
    timing = build.plugin_config["gemm_plugin"] == "cpp" and build.tactic_timing
    table, tactic_seconds, cache = {}, 0.0, None
    with progress(total=4 if timing else 3, desc=f"rank {rank}", disable=not show_progress) as bar:
        weights = load_rank_weights(checkpoint_dir, pretrained, rank)
        lora_modules = () if build.lora_config is None else build.lora_config["lora_target_modules"]
        model = LlamaForCausalLM(pretrained, weights, rank, OpSet(build.op_set), build.quantize_lm_head,
                                 lora_modules, build.hidden_state_layers or ()).eval()
        bar.update(1)
        if timing:
            timed = time.time()
            table, cache = time_tactics(model, pretrained, build)
            tactic_seconds = time.time() - timed
            bar.update(1)
        program = export(model, pretrained, build, rank)
        del model, weights
        bar.update(1)
        shims = backends.COMPILERS[build.backend](program, path, build.max_autotune)
        bar.update(1)
    return RankBuild(rank, time.time() - start, own_peak_rss_mb(), table, tactic_seconds,
                     cache.misses if cache else 0, cache.hits if cache else 0, cache.load if cache else None, shims)


def time_tactics(model, pretrained: PretrainedConfig, build: BuildConfig):
    """Times the GEMM kernels of the rank's packed layers (kiln.plugins.tactics) and sets each
    layer's tactics before export bakes them in: the table, and the timing cache it went through."""
    cache = tactics.TimingCache(build.timing_cache)
    layers = {name: m for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    with torch.no_grad():
        table = tactics.select(layers, torch_dtype(pretrained.dtype), build.max_num_tokens, build.int8_activations,
                               cache)
    cache.save()
    return table, cache


def own_peak_rss_mb() -> float:
    """This process's peak RSS. Not getrusage's: on Linux a child's ru_maxrss starts from its
    parent's RSS at fork, exec or not; VmHWM belongs to the process's own address space."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_ranks(checkpoint_dir: Path, pretrained: PretrainedConfig, build: BuildConfig, out: Path,
                workers: int, on_rank=lambda r: None) -> list[RankBuild]:
    """rank{N}.engine for every rank into `out`; on_rank(RankBuild) as each one finishes."""
    world = pretrained.mapping.world_size
    if workers < 1:
        raise ConfigError(f"workers must be >= 1, got {workers}")
    if workers == 1 or world == 1:
        done = []
        for rank in range(world):
            done.append(build_rank(checkpoint_dir, pretrained, build, rank, out / f"rank{rank}.engine"))
            on_rank(done[-1])
        return done
    return _in_processes(checkpoint_dir, build, out, world, min(workers, world), on_rank)


def _in_processes(checkpoint_dir: Path, build: BuildConfig, out: Path, world: int, workers: int,
                  on_rank) -> list[RankBuild]:
    env = child_env()
    if "OMP_NUM_THREADS" not in env:  # the builds share the cores
        env["OMP_NUM_THREADS"] = str(max(1, available_cpus() // workers))
    pending, running, done = list(range(world)), {}, []
    with tempfile.TemporaryDirectory(dir=out) as results:
        try:
            while pending or running:
                while pending and len(running) < workers:
                    rank = pending.pop(0)
                    result = Path(results) / f"rank{rank}.json"
                    spec = dict(checkpoint_dir=str(checkpoint_dir), build=build.to_dict(), rank=rank,
                                path=str(out / f"rank{rank}.engine"), result=str(result))
                    running[rank] = (subprocess.Popen([sys.executable, "-m", "kiln.build.ranks", json.dumps(spec)],
                                                      env=env, stdout=subprocess.DEVNULL), result)
                time.sleep(0.1)
                for rank, (proc, result) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[rank]
                    report = json.loads(result.read_text()) if result.is_file() else {}
                    if proc.returncode != 0 or "error" in report:
                        raise ConfigError(f"rank {rank}: " + report.get(
                            "error", f"the build process exited with code {proc.returncode}"))
                    done.append(RankBuild(**report))
                    on_rank(done[-1])
        finally:
            for proc, _ in running.values():
                proc.kill()
                proc.wait()
    return sorted(done, key=lambda r: r.rank)


def _main(spec: dict) -> int:
    result = Path(spec["result"])
    try:
        checkpoint_dir = Path(spec["checkpoint_dir"])
        report = asdict(build_rank(checkpoint_dir, PretrainedConfig.load(checkpoint_dir),
                                   BuildConfig.from_dict(spec["build"]), spec["rank"], Path(spec["path"]),
                                   show_progress=False))
    except ConfigError as e:
        report = {"error": str(e)}
    except Exception as e:  # noqa: BLE001 - the parent reports it as this rank's failure
        import traceback

        traceback.print_exc()
        report = {"error": f"{type(e).__name__}: {e}"}
    result.write_text(json.dumps(report))
    return 1 if "error" in report else 0


if __name__ == "__main__":  # one rank's build: python -m kiln.build.ranks SPEC_JSON
    sys.exit(_main(json.loads(sys.argv[1])))
