"""vLLM's engine options by their names and meaning (its `EngineArgs`: what `vllm serve` and
`LLM(...)` take), for `kiln serve`, `LLM` and `AsyncLLM`. `resolve` turns them into an engine dir (an
engine as given, or a Hugging Face dir built on first use with these bounds: kiln/auto_engine.py) and
the engine core's keyword arguments; an engine that cannot honour a value is refused as vLLM refuses
it, naming the option."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from kiln.config import ConfigError, EngineConfig
from kiln.convert.hf_config import default_dtype, pretrained_config_from_hf, read_hf_config

# --quantization -> the quant_algos an engine made from a checkpoint of it has (a bitsandbytes one is
# dequantized: unquantized, or round-to-nearest where convert_checkpoint --qformat asked)
QUANTIZATIONS = {"fp8": ("FP8", "FP8_PER_CHANNEL_PER_TOKEN"), "awq": ("W4A16_AWQ",), "gptq": ("W4A16_GPTQ", "W8A16"),
                 "smoothquant": ("W8A8_SQ_PER_CHANNEL",),
                 "compressed-tensors": ("W4A16", "W8A16", "FP8", "FP8_PER_CHANNEL_PER_TOKEN"),
                 "modelopt": ("FP8",), "bitsandbytes": (None, "W4A16", "W8A16")}
# vLLM's faster kernels' names for a method's checkpoints, which it takes for them
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq"}
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "safetensors")


@dataclass
class EngineArgs:
    """vLLM's names. Each field's comment says what it is on a Kiln engine."""
    model: str
    tensor_parallel_size: int | None = None  # the engine's tp_size (checked), or the one to build with
    pipeline_parallel_size: int | None = None  # likewise pp_size
    max_model_len: int | None = None  # prompt + output tokens per request: at most the engine's max_seq_len
    max_num_seqs: int | None = None  # requests in a step: the core's max_batch_size
    max_num_batched_tokens: int | None = None  # tokens in a step: the core's max_num_tokens
    gpu_memory_utilization: float | None = None  # the share of free memory the KV cache may take
    dtype: str = "auto"  # the weights' dtype: the checkpoint's with auto (float32 as float16, as vLLM)
    quantization: str | None = None  # checked against the engine's or checkpoint's quantization
    load_format: str = "auto"  # safetensors only
    enforce_eager: bool = False  # build with the eager backend (no compiled graph)
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    speculative_config: dict | None = None
    speculative_model: str | None = None  # "[ngram]", or a draft model (engine or HF dir)
    num_speculative_tokens: int | None = None
    ngram_prompt_lookup_max: int | None = None
    ngram_prompt_lookup_min: int | None = None
    enable_lora: bool = False  # needs an engine built with LoRA (engine-build --lora_plugin auto)
    max_lora_rank: int | None = None  # at most the engine's
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    trust_remote_code: bool = False  # no remote code runs in Kiln
    seed: int | None = None  # the default seed of requests without one
    disable_log_stats: bool = False
    disable_log_requests: bool = False
    notes: list[str] = field(default_factory=list)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "notes"]


def resolve(args: EngineArgs, log=print) -> tuple[Path, dict]:
    """(engine dir, the engine core's keyword arguments)."""
    from kiln.auto_engine import BuildRequest, check_model, engine_for, is_hf_dir

    check_model(args.model)
    _check_values(args)
    if args.speculative_model is not None and args.speculative_config is not None:
        raise ConfigError("speculative_model and speculative_config both given: use one")
    if not is_hf_dir(args.model):  # an engine dir, or a broken one: its loader names what is wrong
        engine_dir = Path(args.model)
        _check_engine(args, EngineConfig.load(engine_dir))
    else:
        # Built for vLLM's defaults or what the options ask beyond them, so that the options only a
        # running engine needs (a smaller max_model_len, max_num_seqs, ...) share one engine.
        hf = read_hf_config(args.model)
        qformat, dtype = _qformat(args, hf), _dtype(args, hf)
        derived = _check_positions(args, pretrained_config_from_hf(hf, dtype or default_dtype(hf)))
        request = BuildRequest(dtype=dtype, tp_size=args.tensor_parallel_size or 1,
                               pp_size=args.pipeline_parallel_size or 1, qformat=qformat,
                               max_batch_size=max(args.max_num_seqs or 0, 256),
                               max_seq_len=max(args.max_model_len or 0, derived),
                               max_num_tokens=max(args.max_num_batched_tokens or 0, 2048),
                               backend="eager" if args.enforce_eager else "aoti",
                               lora_config={"max_lora_rank": max(args.max_lora_rank or 0, 16),
                                            "lora_target_modules": LORA_MODULES} if args.enable_lora else None,
                               eagle_model_dir=_eagle_draft(args))
        engine_dir = engine_for(args.model, request, log)
    core = {"max_batch_size": args.max_num_seqs, "max_num_tokens": args.max_num_batched_tokens,
            **_kv_cache(args, EngineConfig.load(engine_dir)), "max_model_len": args.max_model_len,
            "enable_prefix_caching": args.enable_prefix_caching, "enable_chunked_prefill": args.enable_chunked_prefill,
            "max_loras": args.max_loras, "max_cpu_loras": args.max_cpu_loras,
            "speculative_config": _speculative(args, engine_dir, log)}
    return engine_dir, {k: v for k, v in core.items() if v is not None}


LORA_MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate"]


def _check_values(args: EngineArgs) -> None:
    if args.dtype not in DTYPES:
        raise ConfigError(f"dtype {args.dtype!r} is not supported; expected one of {', '.join(DTYPES)}")
    args.quantization = QUANTIZATION_ALIASES.get(args.quantization, args.quantization)
    if args.quantization is not None and args.quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization {args.quantization!r} is not supported by Kiln; expected one of "
                          f"{', '.join(QUANTIZATIONS)}")
    if args.load_format not in LOAD_FORMATS:
        raise ConfigError(f"load_format {args.load_format!r} is not supported: Kiln reads safetensors only (never "
                          f"pickles); expected one of {', '.join(LOAD_FORMATS)}")
    if args.gpu_memory_utilization is not None and not 0 < args.gpu_memory_utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {args.gpu_memory_utilization}")
    if args.trust_remote_code:
        args.notes.append("trust_remote_code: no remote code runs in Kiln; its model families are its own")


def _dtype(args: EngineArgs, hf: dict) -> str | None:
    """vLLM's dtype names; auto: the checkpoint's (None), float32 as float16 (vLLM's rule)."""
    if args.dtype != "auto":
        return {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    return "float16" if default_dtype(hf) == "float32" else None


def _qformat(args: EngineArgs, hf: dict) -> str | None:
    if hf.get("quantization_config") is not None:
        from kiln.convert.prequant import detect

        reader = detect(hf)  # refuses, naming it, a format or field Kiln cannot read
        fp8 = args.quantization == "fp8" and reader.exact and not reader.bits  # FP8 weights, whoever made them
        if args.quantization not in (None, reader.method) and not fp8:
            raise ConfigError(f"Quantization method specified in the model config ({reader.method}) does not match "
                              f"the quantization method specified in the `quantization` argument "
                              f"({args.quantization})")
        return None  # the converter reads it as it is
    if args.quantization not in (None, "fp8"):
        raise ConfigError(f"quantization {args.quantization}: model {args.model} is not {args.quantization}-"
                          f"quantized (its config.json has no quantization_config); vLLM refuses this too. Convert "
                          f"it with convert_checkpoint --qformat int4_awq|int4_gptq|int8_sq and serve the engine")
    return "fp8" if args.quantization == "fp8" else None  # vLLM quantizes an unquantized model to FP8 itself


def _check_positions(args: EngineArgs, pretrained) -> int:
    """The length the model's config derives (kiln.build.settings.deduced_max_seq_len), beyond which
    vLLM refuses a max_model_len unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (its switch, then a warning)."""
    from kiln.build.settings import deduced_max_seq_len

    derived = deduced_max_seq_len(pretrained)
    if args.max_model_len is not None and args.max_model_len > derived:
        message = (f"User-specified max_model_len ({args.max_model_len}) is greater than the derived max_model_len "
                   f"(max_position_embeddings={pretrained.max_position_embeddings} in model's config.json)")
        if os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise ConfigError(f"{message}. To allow overriding this maximum, set the env var "
                              f"VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (as vLLM's); positions past it were never trained")
        args.notes.append(f"warning: {message}; allowed by VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    return derived


def _check_engine(args: EngineArgs, engine: EngineConfig) -> None:
    p, b = engine.pretrained_config, engine.build_config
    for name, wanted, built in (("tensor_parallel_size", args.tensor_parallel_size, p.mapping.tp_size),
                                ("pipeline_parallel_size", args.pipeline_parallel_size, p.mapping.pp_size)):
        if wanted is not None and wanted != built:
            raise ConfigError(f"{name} {wanted}: the engine {args.model} was built for {built} "
                              f"(convert_checkpoint --tp_size / --pp_size); serve it as built, or rebuild it")
    if args.max_model_len is not None and args.max_model_len > b.max_seq_len:
        raise ConfigError(f"max_model_len ({args.max_model_len}) is greater than the engine's max_seq_len "
                          f"({b.max_seq_len}); rebuild it with engine-build --max_seq_len {args.max_model_len}")
    dtype = _dtype_name(args.dtype)
    if dtype is not None and dtype != p.dtype:
        raise ConfigError(f"dtype {args.dtype}: the engine {args.model} holds {p.dtype} weights; pass --dtype auto or "
                          f"rebuild it")
    algo = p.quantization.quant_algo
    if args.quantization is not None and algo not in QUANTIZATIONS[args.quantization]:
        raise ConfigError(f"quantization {args.quantization}: the engine {args.model} is {algo or 'unquantized'}")
    if args.enforce_eager and b.backend != "eager":
        args.notes.append(f"enforce_eager: the engine {args.model} is {b.backend}-compiled; it runs as built (build "
                          f"with engine-build --backend eager for an uncompiled one)")
    lora = b.lora_config
    if args.enable_lora and lora is None:
        raise ConfigError(f"enable_lora: the engine {args.model} was built without LoRA; rebuild it with "
                          f"engine-build --lora_plugin auto --lora_target_modules ...")
    if args.max_lora_rank is not None and lora is not None and args.max_lora_rank > lora["max_lora_rank"]:
        raise ConfigError(f"max_lora_rank {args.max_lora_rank} exceeds the engine's ({lora['max_lora_rank']}); "
                          f"rebuild it with engine-build --max_lora_rank {args.max_lora_rank}")


def _kv_cache(args: EngineArgs, engine: EngineConfig) -> dict:
    """gpu_memory_utilization as the share of free memory the KV cache may take: a pool for every
    request at full length where that fits in it (as Kiln sizes its pool by default), else that share.
    vLLM's GPU pool takes its whole share; on a CPU the memory is the rest of the machine's."""
    if args.gpu_memory_utilization is None:
        return {}
    import psutil

    from kiln.engine.format import kv_cache_dtype

    p, b = engine.pretrained_config, engine.build_config
    per_token = (len(p.layers_of(0)) * 2 * p.kv_heads_per_rank * p.head_size * kv_cache_dtype(p, b).itemsize
                 * p.mapping.world_size)
    blocks = (args.max_num_seqs or b.max_batch_size) * -(-(args.max_model_len or b.max_seq_len) // b.tokens_per_block)
    enough = (blocks + 1) * b.tokens_per_block
    if enough * per_token <= args.gpu_memory_utilization * psutil.virtual_memory().available:
        return {"max_tokens_in_paged_kv_cache": enough}
    return {"kv_cache_free_mem_fraction": args.gpu_memory_utilization}


def _dtype_name(dtype: str) -> str | None:
    return None if dtype == "auto" else {"half": "float16", "float": "float32"}.get(dtype, dtype)


def _eagle_draft(args: EngineArgs) -> str | None:
    """An HF model served with an EAGLE-3 draft ({"method": "eagle3", "model": DRAFT}): the draft is
    converted and built into its engine, which the core then reads it from."""
    config = args.speculative_config
    if not isinstance(config, dict) or config.get("method") != "eagle3" or not config.get("model"):
        return None
    draft = Path(config["model"]).expanduser().resolve()
    if not draft.is_dir():
        raise ConfigError(f"speculative_config model {config['model']}: no such directory (expected an EAGLE-3 "
                          f"draft dir)")
    args.speculative_config = {k: v for k, v in config.items() if k != "model"}
    args.notes.append(f"speculative_config model {config['model']}: the EAGLE-3 draft is converted and built into "
                      f"the model's engine, which speculates with it")
    return str(draft)


def _speculative(args: EngineArgs, engine_dir: Path, log) -> dict | None:
    """vLLM's older options as its speculative_config: "[ngram]" is prompt lookup, a path a draft model."""
    if args.speculative_model is None:
        if args.speculative_config is not None and args.num_speculative_tokens is not None:
            raise ConfigError("num_speculative_tokens goes inside speculative_config")
        return args.speculative_config
    k = args.num_speculative_tokens
    if k is None:
        raise ConfigError("speculative_model needs num_speculative_tokens")
    if args.speculative_model == "[ngram]":
        config = {"method": "ngram", "num_speculative_tokens": k}
        if args.ngram_prompt_lookup_max is not None:
            config["prompt_lookup_max"] = args.ngram_prompt_lookup_max
        if args.ngram_prompt_lookup_min is not None:
            config["prompt_lookup_min"] = args.ngram_prompt_lookup_min
        return config
    from kiln.auto_engine import BuildRequest, engine_for

    target = EngineConfig.load(engine_dir).build_config
    draft = engine_for(args.speculative_model, BuildRequest(dtype=None, max_batch_size=target.max_batch_size,
                                                            max_seq_len=target.max_seq_len,
                                                            max_num_tokens=target.max_num_tokens,
                                                            backend=target.backend), log)
    return {"method": "draft_model", "draft_engine_dir": str(draft), "num_speculative_tokens": k}
