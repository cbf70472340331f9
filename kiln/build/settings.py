"""The build's settings resolved against the checkpoint, before anything is built: the plugins
(TensorRT-LLM's values taken with its meaning), max_seq_len as trtllm-build deduces it, the LoRA
modules of --lora_dir's adapters, the KV cache dtype, autotuning and the lm_head's quantization."""

from kiln.config import ELEMENTWISE_PLUGINS, BuildConfig, ConfigError, PretrainedConfig
from kiln.engine.format import kv_cache_dtype
from kiln.models.linear import INT4_ALGOS
from kiln.models.lora import MODULE_IDS, check_lora_config
from kiln.models.ops import op_set

# TensorRT-LLM's plugin values: "auto" (the checkpoint's dtype) or a dtype turn a plugin on, "disable"
# turns it off; Kiln's "cpp" is the plugin on, "inline" off (traced for the compiler), "python" the
# kiln:: Python op.
PLUGIN_ON = ("auto", "float16", "bfloat16", "float32", "int32", "fp8")
KILN_VALUES = ("cpp", "inline", "python", "triton")
DEVICES = ("cpu", "cuda")


def resolve(build: BuildConfig, pretrained: PretrainedConfig, log, lora_dirs=()) -> None:
    """Fills in every setting of `build` left to the builder, for this checkpoint; ConfigError names
    the first one that cannot be."""
    resolve_device(build)
    resolve_plugins(build, pretrained, log)
    resolve_max_seq_len(build, pretrained, log)
    if lora_dirs:
        lora_from_adapters(build, pretrained, lora_dirs, log)
    if build.lora_config is not None:
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
        # prefill 1.1-2.1x, build 0.6x the time, engine half the size. float32 keeps ATen's GEMMs: MKL's
        # sgemm has no weights to decode, and float32 engines are the HF-parity reference.
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
    build.op_set = op_set.choose(build.plugin_config)


def resolve_device(build: BuildConfig) -> None:
    """--device and --kernels: where the engine runs, and the Triton kernels for every plugin left
    to the builder when --kernels triton."""
    if build.target_device not in DEVICES:
        raise ConfigError(f"--device {build.target_device!r} is not supported; expected one of {', '.join(DEVICES)}")
    if build.target_device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA GPU is visible here (torch.cuda.is_available() is False); "
                              "build on the GPU the engine will serve on, or use --device cpu")
        raise ConfigError("--device cuda: Kiln does not build CUDA engines yet (its Triton kernels are verified in "
                          "Triton's interpreter only); use --device cpu")
    if build.kernels == "triton":
        from kiln.plugins import gpu

        gpu.check_runnable("cpu")
        if build.backend != "eager":
            raise ConfigError("--kernels triton on CPU needs --backend eager: Triton's interpreter runs the kernels "
                              "op by op, and AOTInductor compiles Triton kernels for CUDA GPUs only")
        for key in op_set.GROUPS.values():
            if build.plugin_config.get(key) is None:
                build.plugin_config[key] = "triton"


def resolve_plugins(build: BuildConfig, pretrained: PretrainedConfig, log) -> None:
    """TensorRT-LLM's values of gpt_attention_plugin and gemm_plugin as Kiln's: the plugin on (cpp) or
    off (inline). Its plugins compute in the weights' dtype, so a dtype other than the checkpoint's is
    said in one line."""
    for key in ("gpt_attention_plugin", "gemm_plugin"):
        value = build.plugin_config.get(key)
        if value is None or value in KILN_VALUES:
            continue
        if value == "disable":
            build.plugin_config[key] = "inline"
        elif value in PLUGIN_ON:
            build.plugin_config[key] = on = "triton" if build.kernels == "triton" else "cpp"
            weights = "fp8" if pretrained.quantization.quant_algo == "FP8" else pretrained.dtype
            if value not in ("auto", weights):
                log(f"--{key} {value}: the {'Triton' if on == 'triton' else 'C++'} plugin, computing in the "
                    f"checkpoint's {weights} (Kiln's plugins compute in the weights' dtype)")
        elif value == "nvfp4":
            raise ConfigError(f"--{key} nvfp4: NVFP4 GEMMs are not supported by Kiln")
        else:
            raise ConfigError(f"{key} {value!r} is not supported; expected one of "
                              f"{', '.join(PLUGIN_ON + ('disable',) + KILN_VALUES)}")
    for key in ELEMENTWISE_PLUGINS:
        if build.plugin_config.get(key) not in (None, *KILN_VALUES):
            raise ConfigError(f"{key} {build.plugin_config[key]!r} is not supported; expected one of "
                              f"{', '.join(KILN_VALUES)}")


def rope_factor(pretrained: PretrainedConfig) -> float:
    """How far rope scaling stretches the model's positions (none for llama3 and LongRoPE, whose
    factors reshape frequencies, not the length), as trtllm-build and vLLM derive the length."""
    scaling = pretrained.rotary_scaling or {}
    return 1 if scaling.get("type") in (None, "llama3", "longrope") else scaling.get("factor") or 1


def deduced_max_seq_len(pretrained: PretrainedConfig) -> int:
    return int(-(-pretrained.max_position_embeddings * rope_factor(pretrained) // 1))


def resolve_max_seq_len(build: BuildConfig, pretrained: PretrainedConfig, log) -> None:
    """As trtllm-build: unset, the model's positions times its rope factor; set beyond them, kept, with
    a warning (rotary embeddings compute any position; the model has not seen them)."""
    factor, positions = rope_factor(pretrained), pretrained.max_position_embeddings
    if build.max_seq_len is None:
        build.max_seq_len = deduced_max_seq_len(pretrained)
        log(f"max_seq_len is not specified, using deduced value {build.max_seq_len}")
        if build.max_input_len > build.max_seq_len:
            log(f"warning: max_input_len {build.max_input_len} is larger than max_seq_len {build.max_seq_len}, "
                f"clipping it to max_seq_len")
            build.max_input_len = build.max_seq_len
        BuildConfig.__post_init__(build)
    elif build.max_seq_len > positions * factor:
        log(f"warning: max_seq_len {build.max_seq_len} is larger than max_position_embeddings {positions} * rotary "
            f"scaling {factor}, the model accuracy might be affected (built as asked, as trtllm-build does)")


def lora_from_adapters(build: BuildConfig, pretrained: PretrainedConfig, lora_dirs, log) -> None:
    """trtllm-build's --lora_dir: the adapters are read and checked; without --lora_target_modules the
    engine takes the modules they adapt."""
    from kiln.lora.adapter import read_adapter

    if build.lora_config is None:
        raise ConfigError("--lora_dir needs --lora_plugin auto")
    adapters = [read_adapter(d, pretrained) for d in lora_dirs]
    config = build.lora_config
    if not config["lora_target_modules"]:
        config["lora_target_modules"] = sorted({m for a in adapters for m in a.modules},
                                               key=list(MODULE_IDS).index)
    for a in adapters:
        outside = sorted(set(a.modules) - set(config["lora_target_modules"]))
        if a.rank > config["max_lora_rank"] or outside:
            raise ConfigError(f"--lora_dir {a.path}: rank {a.rank} and modules {', '.join(a.modules)} do not fit the "
                              f"engine's --max_lora_rank {config['max_lora_rank']} and --lora_target_modules "
                              f"{' '.join(config['lora_target_modules'])}")
    log(f"LoRA: {len(adapters)} adapter(s) fit; modules {' '.join(config['lora_target_modules'])}, "
        f"max rank {config['max_lora_rank']}")


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


