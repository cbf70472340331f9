"""`engine-build`: compile a checkpoint dir into an engine dir."""
import shutil
from pathlib import Path

import click

from kiln.build import trtllm_flags
from kiln.build.trtllm_flags import KILN_PLUGIN_VALUES, LOG_LEVELS, PLUGIN_DTYPES
from kiln.config import BACKENDS, ELEMENTWISE_PLUGINS, BuildConfig, ConfigError
from kiln.utils import expand_lists

BUILD_OPTIONS = [
    click.option("--max_batch_size", type=int, default=8, show_default=True,
                 help="Most requests in one engine step."),
    click.option("--max_input_len", type=int, default=512, show_default=True,
                 help="Longest prompt, in tokens."),
    click.option("--max_seq_len", "--max_decoder_seq_len", type=int, default=None,
                 help="Longest prompt + generated tokens of one request. Default: the model's "
                      "max_position_embeddings (times its rope scaling factor), as trtllm-build deduces it."),
    click.option("--max_num_tokens", type=int, default=1024, show_default=True,
                 help="Most tokens in one engine step (prefill chunks + decodes)."),
    click.option("--tokens_per_block", type=int, default=32, show_default=True,
                 help="Tokens per paged-KV block."),
    click.option("--max_beam_width", type=int, default=1, show_default=True,
                 help="Widest beam search a request may ask for (1: none). Each beam takes a batch slot."),
    click.option("--backend", type=click.Choice(BACKENDS), default="aoti", show_default=True,
                 help="aoti: AOTInductor-compiled package; eager: the exported program, uncompiled."),
    click.option("--device", "target_device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True,
                 help="Where the engine runs. cuda: refused for now (Kiln builds no CUDA engine yet); without a "
                      "GPU, a one-line error."),
    click.option("--kernels", type=click.Choice(["cpu", "triton"]), default="cpu", show_default=True,
                 help="cpu: the plugins' C++ or inline kernels; triton: every plugin left unset on Kiln's OpenAI "
                      "Triton kernels (the GPU op set), which on CPU run in Triton's interpreter "
                      "(TRITON_INTERPRET=1, --backend eager): to check them, not to serve fast."),
    click.option("--max_autotune/--no_max_autotune", default=None,
                 help="aoti: benchmark Inductor's GEMM kernels while compiling (a longer build; 2-3x faster "
                      "bf16/fp16 GEMMs than ATen's on CPU). Default: on for bf16/fp16 builds with "
                      "--gemm_plugin inline; off otherwise (the plugin leaves no GEMM to tune)."),
    click.option("--gpt_attention_plugin", type=click.Choice([*PLUGIN_DTYPES, "disable", *KILN_PLUGIN_VALUES]),
                 default=None,
                 help="auto (or a dtype, TensorRT-LLM's values): the C++ paged-attention plugin, which reads KV pages "
                      "in place; disable: attention traced inline for the compiler. Kiln's names: cpp, inline, "
                      "python (the kiln:: Python op, for debugging). Default: cpp for aoti, inline for eager."),
    click.option("--gemm_plugin", type=click.Choice([*PLUGIN_DTYPES, "fp8", "nvfp4", "disable", *KILN_PLUGIN_VALUES]),
                 default=None,
                 help="auto (or a dtype, or fp8: TensorRT-LLM's values): linear layers on the C++ GEMM plugin "
                      "(weights packed, kept int8/int4/fp8 when quantized, decoded in the kernel, computed in the "
                      "checkpoint's dtype); disable: traced inline onto ATen / Inductor GEMMs. Kiln's names: cpp, "
                      "inline. Default: cpp for aoti with bf16/fp16 or quantized weights, else inline."),
    click.option("--elementwise_plugins", type=click.Choice(KILN_PLUGIN_VALUES), default=None,
                 help="RMSNorm, rotary embedding and SwiGLU as kiln_cpp's C++ ops (on the kernels' thread pool), "
                      "traced inline for the compiler, or the kiln:: Python ops (debugging). Default: cpp where "
                      "the attention and GEMM plugins are cpp, else inline."),
    click.option("--tactic_timing/--no_tactic_timing", default=True, show_default=True,
                 help="With --gemm_plugin cpp: time every GEMM kernel that runs on this machine (the plugin's "
                      "AVX2/AVX-512-BF16/AMX/int8 kernels, ATen's) per GEMM and token-count bucket, keep the "
                      "fastest, and print the table. Off: the op's own untimed choice."),
    click.option("--timing_cache", default=None, type=click.Path(dir_okay=False),
                 help="JSON file of kernel timings, read and extended by the build: a rebuild on the same "
                      "machine, library and thread count reuses the measurements."),
    click.option("--int8_activations/--no_int8_activations", default=True, show_default=True,
                 help="Let int8/int4 weights' GEMMs quantize activations to int8 (one scale per 128 k, or per int4 group) where "
                      "that times faster, as llama.cpp and ORT GenAI do: faster small-batch decode, slightly "
                      "different arithmetic (benchmarks/quant.py reports the perplexity cost). "
                      "--no_int8_activations: W8A16/W4A16 as specified."),
    click.option("--quantize_lm_head", type=click.Choice(["auto", "none", "int8", "int4"]), default="auto",
                 show_default=True,
                 help="Quantize the lm_head at build time (round to nearest): int8 per row, or int4 per group "
                      "(the checkpoint's group size). auto: int8 for int8/int4 weight-only checkpoints, whose "
                      "decode reads the bf16 lm_head more than all their layers (measured lossless), else none. "
                      "Needs --gemm_plugin cpp. A tied embedding reads its rows out of the same table."),
    click.option("--lora_plugin", type=click.Choice([*PLUGIN_DTYPES, "disable"]), default="disable", show_default=True,
                 help="auto (or a dtype): build in LoRA adapters' updates (--lora_target_modules, --max_lora_rank, "
                      "or both read from --lora_dir); the adapters themselves come with requests, in slots of the "
                      "runtime's max_loras."),
    click.option("--max_lora_rank", type=int, default=64, show_default=True,
                 help="With --lora_plugin: the largest adapter rank the engine takes."),
    click.option("--lora_target_modules", multiple=True,
                 type=click.Choice(["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h",
                                    "mlp_gate"]),
                 help="With --lora_plugin: the modules adapters may adapt (TensorRT-LLM's names; HF's q/k/v/o_proj, "
                      "gate_proj, down_proj, up_proj in that order). Repeat, or give several after one flag."),
    click.option("--workers", type=int, default=1, show_default=True,
                 help="Rank engines compiled at once, each in a process of its own that reads only its "
                      "rank's weights (1: every rank in turn, in this process)."),
    click.option("--log_level", type=click.Choice(LOG_LEVELS), default="info", show_default=True,
                 help="info: what was built, where, how long, and the kernel chosen per GEMM shape; verbose (debug, "
                      "trace): also every tactic's timing per token bucket; warning (error, internal_error): "
                      "warnings and errors only."),
    click.option("--dry_run", is_flag=True, default=False,
                 help="Check the checkpoint and every option, build nothing."),
    click.option("--build_config", "build_config_file", type=click.Path(dir_okay=False, exists=True), default=None,
                 help="trtllm-build's JSON of build options (plugin_config included), read as if given here; "
                      "options given on the command line win."),
    click.option("--lora_dir", multiple=True, type=click.Path(file_okay=False, exists=True),
                 help="With --lora_plugin: Hugging Face PEFT adapter dirs whose target modules (unless "
                      "--lora_target_modules) the engine takes; each adapter's rank must fit --max_lora_rank."),
    click.option("--input_timing_cache", type=click.Path(dir_okay=False), default=None,
                 help="A timing cache (--timing_cache) to start from; ignored if the file does not exist."),
    click.option("--output_timing_cache", type=click.Path(dir_okay=False), default=None,
                 help="Where to write the timing cache (--timing_cache) this build extends."),
]


def build_options(f):
    for option in reversed(BUILD_OPTIONS + trtllm_flags.click_options()):
        f = option(f)
    return f


# Options that take several values after one flag, as TensorRT-LLM's argparse (nargs='+') does.
LIST_OPTIONS = ("--lora_target_modules", "--lora_dir")


class _Command(click.Command):
    """`--lora_target_modules attn_q attn_k ...`: TensorRT-LLM's list options take several values."""

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, expand_lists(args, LIST_OPTIONS))


VERBOSE = ("verbose", "debug", "trace")
QUIET = ("warning", "error", "internal_error")


@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint_dir", required=True, type=click.Path(file_okay=False),
              help="Checkpoint dir written by convert_checkpoint (config.json, rank{N}.safetensors).")
@click.option("--output_dir", required=True, type=click.Path(file_okay=False),
              help="Engine dir to write (config.json, rank{N}.engine, tokenizer files).")
@click.option("--tokenizer_dir", default=None, type=click.Path(file_okay=False),
              help="Dir to copy the tokenizer files from. Default: the checkpoint dir (ModelOpt exports have "
                   "none: pass the HF model dir).")
@build_options
@click.pass_context
def main(ctx, checkpoint_dir, output_dir, tokenizer_dir, **options):
    """Compile a Kiln/TensorRT-LLM checkpoint into a serialized engine dir.

    The output is written to a temporary dir beside OUTPUT_DIR and renamed into place when
    every rank has compiled, so a failed build leaves nothing behind.

    trtllm-build's options are taken with its values (--gemm_plugin auto, --paged_kv_cache enable,
    --kv_cache_type paged, --remove_input_padding enable, --use_paged_context_fmha enable, ...): those
    Kiln's CPU build always does one way are accepted and said in one line of the output; those
    asking for a feature Kiln lacks are refused, naming it.
    """
    from kiln.build.builder import build_engine

    try:
        if options["build_config_file"]:
            _apply_build_config(ctx, options)
        level = options.pop("log_level")
        quiet = level in QUIET

        def log(line: str) -> None:
            if not quiet or line.startswith("warning"):
                click.echo(line)

        trtllm = {name: options.pop(name) for name in trtllm_flags.FLAGS}
        for line in trtllm_flags.notes(trtllm):
            log(line)
        build = BuildConfig(**_kiln_options(options))
        build_engine(checkpoint_dir, output_dir, build, log=log, tokenizer_dir=tokenizer_dir,
                     workers=options["workers"], verbose=level in VERBOSE, dry_run=options["dry_run"],
                     lora_dirs=options["lora_dir"])
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


def _kiln_options(options: dict) -> dict:
    """BuildConfig's fields from the parsed options."""
    lora_plugin, modules = options["lora_plugin"], list(options["lora_target_modules"])
    out = {k: options[k] for k in ("max_batch_size", "max_input_len", "max_seq_len", "max_num_tokens",
                                   "tokens_per_block", "max_beam_width", "backend", "max_autotune", "tactic_timing",
                                   "int8_activations", "quantize_lm_head",
                                   "target_device", "kernels")}
    if lora_plugin != "disable":
        out["lora_config"] = {"max_lora_rank": options["max_lora_rank"], "lora_target_modules": modules}
    elif modules or options["lora_dir"]:
        raise ConfigError(f"--{'lora_target_modules' if modules else 'lora_dir'} needs --lora_plugin auto")
    out["timing_cache"] = _timing_cache(options)
    out["plugin_config"] = {"gpt_attention_plugin": options["gpt_attention_plugin"],
                            "gemm_plugin": options["gemm_plugin"],
                            **dict.fromkeys(ELEMENTWISE_PLUGINS, options["elementwise_plugins"])}
    return out


def _timing_cache(options: dict):
    """--timing_cache, or trtllm-build's pair: the cache read from --input_timing_cache (if it exists)
    and written to --output_timing_cache."""
    source, target = options["input_timing_cache"], options["output_timing_cache"]
    if source and target and source != target and Path(source).is_file():
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    return target or source or options["timing_cache"]


def _apply_build_config(ctx, options: dict) -> None:
    """trtllm-build's --build_config JSON: its keys as options, under those given on the command line."""
    data = trtllm_flags.read_build_config(options["build_config_file"])
    names = {p.name: p for p in ctx.command.params}
    unknown = sorted(k for k, v in data.items() if k not in names and v not in (None, False, 0, "", [], {}))
    if unknown:
        raise ConfigError(f"--build_config {options['build_config_file']}: key(s) {', '.join(unknown)} are not "
                          f"build options Kiln takes")
    for key, value in data.items():
        if key not in names or ctx.get_parameter_source(key) == click.core.ParameterSource.COMMANDLINE:
            continue
        if isinstance(value, bool) and isinstance(names[key].type, click.Choice) and "enable" in names[key].type.choices:
            value = "enable" if value else "disable"
        try:
            options[key] = names[key].type_cast_value(ctx, value) if value is not None else options[key]
        except click.BadParameter as e:
            raise ConfigError(f"--build_config {options['build_config_file']}: {key}: {e.message}") from None
