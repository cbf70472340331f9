"""`engine-build`: compile a checkpoint dir into an engine dir."""
import click

from kiln.config import BACKENDS, ELEMENTWISE_PLUGINS, BuildConfig, ConfigError

BUILD_OPTIONS = [
    click.option("--max_batch_size", type=int, default=8, show_default=True,
                 help="Most requests in one engine step."),
    click.option("--max_input_len", type=int, default=512, show_default=True,
                 help="Longest prompt, in tokens."),
    click.option("--max_seq_len", type=int, default=1024, show_default=True,
                 help="Longest prompt + generated tokens of one request."),
    click.option("--max_num_tokens", type=int, default=1024, show_default=True,
                 help="Most tokens in one engine step (prefill chunks + decodes)."),
    click.option("--tokens_per_block", type=int, default=32, show_default=True,
                 help="Tokens per paged-KV block."),
    click.option("--max_beam_width", type=int, default=1, show_default=True,
                 help="Widest beam search a request may ask for (1: none). Each beam takes a batch slot."),
    click.option("--backend", type=click.Choice(BACKENDS), default="aoti", show_default=True,
                 help="aoti: AOTInductor-compiled package; eager: the exported program, uncompiled."),
    click.option("--max_autotune/--no_max_autotune", default=None,
                 help="aoti: benchmark Inductor's GEMM kernels while compiling (a longer build; 2-3x faster "
                      "bf16/fp16 GEMMs than ATen's on CPU). Default: on for bf16/fp16 builds with "
                      "--gemm_plugin inline; off otherwise (the plugin leaves no GEMM to tune)."),
    click.option("--gpt_attention_plugin", type=click.Choice(["cpp", "inline", "auto"]), default=None,
                 help="Paged attention as the C++ plugin (reads KV pages in place), traced inline for the "
                      "compiler, or the kiln:: Python op (debugging). Default: cpp for aoti, inline for "
                      "eager."),
    click.option("--gemm_plugin", type=click.Choice(["cpp", "inline"]), default=None,
                 help="Linear layers on the C++ GEMM plugin (weights packed, kept int8/int4/fp8 when "
                      "quantized, decoded in the kernel) or traced inline onto ATen / Inductor GEMMs. "
                      "Default: cpp for aoti with bf16/fp16 or quantized weights, else inline."),
    click.option("--elementwise_plugins", type=click.Choice(["cpp", "inline", "auto"]), default=None,
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
    click.option("--lora_plugin", type=click.Choice(["auto", "disable"]), default="disable", show_default=True,
                 help="auto: build in LoRA adapters' updates (--lora_target_modules, --max_lora_rank); the adapters "
                      "themselves come with requests, in slots of the runtime's max_loras."),
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
]


def build_options(f):
    for option in reversed(BUILD_OPTIONS):
        f = option(f)
    return f


class _Command(click.Command):
    """TensorRT-LLM's `--lora_target_modules attn_q attn_k ...` (argparse's nargs='+'): the names after
    the flag are read as if the flag were repeated before each."""

    def parse_args(self, ctx, args):
        out, listing = [], False
        for arg in args:
            if arg.startswith("-"):
                listing = arg == "--lora_target_modules"
            elif listing and out[-1] != "--lora_target_modules":
                out.append("--lora_target_modules")
            out.append(arg)
        return super().parse_args(ctx, out)


@click.command(cls=_Command, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--checkpoint_dir", required=True, type=click.Path(file_okay=False),
              help="Checkpoint dir written by convert_checkpoint (config.json, rank{N}.safetensors).")
@click.option("--output_dir", required=True, type=click.Path(file_okay=False),
              help="Engine dir to write (config.json, rank{N}.engine, tokenizer files).")
@click.option("--tokenizer_dir", default=None, type=click.Path(file_okay=False),
              help="Dir to copy the tokenizer files from. Default: the checkpoint dir (ModelOpt exports have "
                   "none: pass the HF model dir).")
@build_options
def main(checkpoint_dir, output_dir, workers, tokenizer_dir, gpt_attention_plugin, gemm_plugin, elementwise_plugins,
         lora_plugin, max_lora_rank, lora_target_modules, **options):
    """Compile a Kiln/TensorRT-LLM checkpoint into a serialized engine dir.

    The output is written to a temporary dir beside OUTPUT_DIR and renamed into place when
    every rank has compiled, so a failed build leaves nothing behind.
    """
    from kiln.build.builder import build_engine

    try:
        if lora_plugin == "auto":
            options["lora_config"] = {"max_lora_rank": max_lora_rank, "lora_target_modules": list(lora_target_modules)}
        elif lora_target_modules:
            raise ConfigError("--lora_target_modules needs --lora_plugin auto")
        build = BuildConfig(**options)
        build.plugin_config["gpt_attention_plugin"] = gpt_attention_plugin
        build.plugin_config["gemm_plugin"] = gemm_plugin
        build.plugin_config.update(dict.fromkeys(ELEMENTWISE_PLUGINS, elementwise_plugins))
        build_engine(checkpoint_dir, output_dir, build, log=click.echo, tokenizer_dir=tokenizer_dir, workers=workers)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None
