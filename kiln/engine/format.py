"""The engine format: what a rank engine takes and returns (DESIGN.md, "The engine format").

engine-build writes an engine dir of `config.json` (`pretrained_config` + `build_config`) and one
`rank{N}.engine` per rank; the runtime loads them (kiln/engine/loader.py). Both sides agree on the
names below, the KV pool's dtype and the files, and on nothing else of each other.
"""
import json
from pathlib import Path

import torch

from kiln.config import BuildConfig, PretrainedConfig, torch_dtype

# The keyword arguments of one engine step, in the order the model takes them; all are tensors whose
# shapes carry the step's sizes, built by the host (kiln/runtime/core/step_plan.py).
STEP_INPUTS = ("input_ids", "positions", "slot_mapping", "ctx_token_index", "ctx_block_tables",
               "ctx_context_lens", "gen_token_index", "gen_block_tables", "gen_context_lens",
               "logits_index", "kv_cache")
# Pipeline stages after the first also take the previous stage's output, [T, hidden_size]; a stage
# before the last returns it instead of logits.
HIDDEN_STATES = "hidden_states"
# LongRoPE models (PretrainedConfig.long_rope_threshold) also take each token's sequence length, [T]
# int64: the tokens of a sequence longer than the threshold rotate with the long factors.
SEQUENCE_LENS = "sequence_lens"
# LoRA engines (BuildConfig.lora_config) also take each token's adapter slot, [T] int64 (-1: none), each
# slot's adapter rank, [slots] int64 (0: empty), and the adapter pools, a dict of target module ->
# [layers, slots, max_lora_rank, in + out] (kiln/models/lora.py).
LORA_SLOTS, LORA_RANKS, LORA_POOLS = "lora_slots", "lora_ranks", "lora_pools"

KV_CACHE_QUANT_DTYPES = {"FP8": torch.float8_e4m3fn, "INT8": torch.int8}


def lora_pool_shapes(pretrained: PretrainedConfig, build: BuildConfig, rank: int,
                     max_loras: int) -> dict[str, tuple[int, ...]]:
    from kiln.models.lora import module_shapes

    layers = len(pretrained.layers_of(pretrained.mapping.pp_rank(rank)))
    shapes = module_shapes(pretrained)
    return {m: (layers, max_loras, build.lora_config["max_lora_rank"], sum(shapes[m]))
            for m in build.lora_config["lora_target_modules"]}


def engine_file(engine_dir, rank: int) -> Path:
    return Path(engine_dir) / f"rank{rank}.engine"


def kv_cache_dtype(pretrained: PretrainedConfig, build: BuildConfig) -> torch.dtype:
    algo = pretrained.quantization.kv_cache_quant_algo
    if algo:
        return KV_CACHE_QUANT_DTYPES[algo]
    return torch_dtype(build.kv_cache_dtype or pretrained.dtype)


def plugin_config(engine_dir) -> dict:
    """The plugin_config the engine in engine_dir was built with ({} where it cannot be read)."""
    try:
        plugins = json.loads((Path(engine_dir) / "config.json").read_text())["build_config"]["plugin_config"]
        return plugins if isinstance(plugins, dict) else {}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


# The custom-op libraries an engine's graph may call: the kiln:: Python ops (kiln/plugins/ops.py) and
# the kiln_cpp:: C++ plugins (kiln/plugins/cpp.py, built once per machine).
OP_LIBRARIES = ("kiln", "kiln_cpp", "kiln_gpu")


def op_libraries(pretrained: PretrainedConfig, build: BuildConfig) -> tuple[str, ...]:
    """The op libraries an engine of this config calls, which must be registered before its graph is
    deserialized (an eager engine names its ops in the serialized graph; an aoti one resolves the
    kiln_cpp C shims when it loads). Decided here, from the config alone, for every entry point; the
    build checks the exported graph against it (kiln/build/export.py)."""
    plugins = build.plugin_config
    libraries = ["kiln"]  # cheap, and whatever a plugin value names a Python op
    # A mixture of experts runs the fused kiln_cpp::moe op unless its GEMMs are Triton's, and tensor
    # parallelism kiln_cpp's collectives, whatever the plugins: neither has an inline form.
    experts_on_cpp = pretrained.moe.num_experts and plugins.get("gemm_plugin") != "triton"
    if "cpp" in plugins.values() or experts_on_cpp or pretrained.mapping.tp_size > 1:
        libraries.append("kiln_cpp")
    if "triton" in plugins.values():
        libraries.append("kiln_gpu")
    return tuple(libraries)


def warmup_inputs() -> dict:
    """One decode token at position 0 of block 0, without the KV pool: every rank runs every
    collective and send of a step once while loading, so that a rank that cannot fails the start.
    Block 0's slot is written before any sequence reads it."""
    i64, i32 = dict(dtype=torch.int64), dict(dtype=torch.int32)
    return dict(input_ids=torch.zeros(1, **i64), positions=torch.zeros(1, **i64), slot_mapping=torch.zeros(1, **i64),
                ctx_token_index=torch.zeros(0, 1, **i64), ctx_block_tables=torch.zeros(0, 1, **i32),
                ctx_context_lens=torch.zeros(0, **i32), gen_token_index=torch.zeros(1, **i64),
                gen_block_tables=torch.zeros(1, 1, **i32), gen_context_lens=torch.ones(1, **i32),
                logits_index=torch.zeros(1, **i64), sequence_lens=torch.ones(1, **i64),
                lora_slots=torch.full((1,), -1, **i64))
