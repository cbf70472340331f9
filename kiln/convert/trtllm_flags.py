"""TensorRT-LLM's `convert_checkpoint.py` options under their own names and meaning (its Llama
converter, which its Mistral, Mixtral and Qwen examples share), so that its users' command lines run
as written. The quantization flags become Kiln's --qformat / --kv_cache_dtype; an option Kiln's
converter does not need is accepted and said in one line; one asking for a feature Kiln lacks is a
one-line ConfigError naming the feature. Kiln's own options keep working."""
from __future__ import annotations

from dataclasses import dataclass, field

import click

from kiln.config import ConfigError

# --use_weight_only --weight_only_precision P -> Kiln's --qformat
WEIGHT_ONLY = {"int8": "int8_wo", "int4": "int4_wo", "int4_gptq": "int4_gptq", "int4_awq": "int4_awq"}
LOG_LEVELS = ("internal_error", "error", "warning", "info", "verbose", "debug", "trace")
DUMMY_MODEL = ("vocab_size", "n_positions", "n_layer", "n_head", "n_kv_head", "n_embd", "inter_size",
               "multiple_of", "ffn_dim_multiplier", "rms_norm_eps", "hidden_act", "rotary_base", "moe_num_experts",
               "moe_top_k", "moe_renorm_mode")


def click_options() -> list:
    """The options Kiln's own do not cover, hidden from --help (whose text says they are taken)."""
    flag = dict(is_flag=True, default=False, hidden=True)
    return [
        click.option("--use_weight_only", **flag),
        click.option("--weight_only_precision", type=click.Choice([*WEIGHT_ONLY, "int8_gptq"]), is_flag=False,
                     flag_value="int8", default=None, hidden=True),
        click.option("--disable_weight_only_quant_plugin", **flag),
        click.option("--use_fp8", **flag),
        click.option("--use_fp8_rowwise", **flag),
        click.option("--use_meta_fp8_rowwise_recipe", **flag),
        click.option("--use_nvfp4", **flag),
        click.option("--use_qserve", **flag),
        click.option("--smoothquant", "-sq", type=float, default=None, hidden=True),
        click.option("--per_channel", **flag),
        click.option("--per_token", **flag),
        click.option("--per_group", **flag),
        click.option("--int8_kv_cache", **flag),
        click.option("--fp8_kv_cache", **flag),
        click.option("--quant_ckpt_path", default=None, hidden=True),
        click.option("--meta_ckpt_dir", default=None, hidden=True),
        click.option("--cp_size", type=int, default=1, hidden=True),
        click.option("--workers", type=int, default=None, hidden=True),
        click.option("--load_by_shard", **flag),
        click.option("--load_model_on_cpu", **flag),
        click.option("--use_parallel_embedding", **flag),
        click.option("--embedding_sharding_dim", type=click.Choice(["0", "1"]), default=None, hidden=True),
        click.option("--use_embedding_sharing", **flag),
        click.option("--remove_duplicated_kv_heads", **flag),
        click.option("--save_config_only", **flag),
        click.option("--log_level", type=click.Choice(LOG_LEVELS), default="info", hidden=True),
        # TensorRT-LLM's EAGLE example's: EAGLE-1/2's draft tree, set at conversion there
        click.option("--max_draft_len", type=int, default=None, hidden=True),
        click.option("--num_eagle_layers", type=int, default=None, hidden=True),
        click.option("--max_non_leaves_per_layer", type=int, default=None, hidden=True),
        *[click.option(f"--{name}", default=None, hidden=True) for name in DUMMY_MODEL],
    ]


@dataclass
class Quantization:
    """What the flags ask for, in Kiln's terms."""
    qformat: str | None
    kv_cache_dtype: str | None
    smoothquant_alpha: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def default_calibration(self) -> bool:
        """TensorRT-LLM calibrates on its default dataset when none is given."""
        return self.qformat is not None or self.kv_cache_dtype is not None


def quantization(flags: dict) -> Quantization | None:
    """The quantization the TensorRT-LLM flags in `flags` ask for (None: none of them given)."""
    notes, qformat, alpha = [], None, None
    if flags["use_fp8_rowwise"] or flags["use_meta_fp8_rowwise_recipe"]:
        raise ConfigError("--use_fp8_rowwise: FP8 row-wise (per-token, per-channel) quantization is not supported "
                          "by Kiln; --use_fp8 gives per-tensor FP8")
    for name, what in (("use_nvfp4", "NVFP4 quantization"), ("use_qserve", "QServe W4A8 quantization")):
        if flags[name]:
            raise ConfigError(f"--{name}: {what} is not supported by Kiln")
    if flags["quant_ckpt_path"]:
        raise ConfigError("--quant_ckpt_path: a GPTQ-for-LLaMa weights file beside the HF model is not read by Kiln; "
                          "pass a GPTQ model dir (config.json with its quantization_config, as GPTQModel and "
                          "transformers write it) as --model_dir, which converts as it is")
    precision = flags["weight_only_precision"]
    if flags["use_weight_only"]:
        precision = precision or "int8"
        if precision == "int8_gptq":
            raise ConfigError("--weight_only_precision int8_gptq: int8 GPTQ is not supported by Kiln; int4_gptq is")
        qformat = WEIGHT_ONLY[precision]
        if precision == "int4":
            notes.append("--weight_only_precision int4: int4 weights with a scale per group of inputs (Kiln's "
                         "int4_wo, finer than TensorRT-LLM's per-channel W4A16)")
    elif precision is not None:
        notes.append(f"--weight_only_precision {precision}: no effect without --use_weight_only (as in TensorRT-LLM)")
    if flags["use_fp8"]:
        qformat = _one(qformat, "fp8", "--use_fp8")
        notes.append("--use_fp8: FP8 weights and activations with per-tensor scales, calibrated with ModelOpt (the "
                     "checkpoint is unquantized; TensorRT-LLM's quantize.py --qformat fp8)")
    if flags["smoothquant"]:  # as TensorRT-LLM tests it: 0.0 means no SmoothQuant
        if flags["per_token"]:
            raise ConfigError("--per_token: SmoothQuant with per-token activation scales is not supported by Kiln; "
                              "drop --per_token for per-tensor activation scales (W8A8_SQ_PER_CHANNEL)")
        qformat, alpha = _one(qformat, "int8_sq", "--smoothquant"), flags["smoothquant"]
        if not 0 <= alpha <= 1:
            raise ConfigError(f"--smoothquant {alpha:g}: alpha must be in [0, 1]")
        if not flags["per_channel"]:
            notes.append("--smoothquant without --per_channel: Kiln's int8_sq scales weights per channel")
    elif flags["per_token"] or flags["per_channel"]:
        notes.append("--per_token / --per_channel: no effect without --smoothquant (as in TensorRT-LLM)")
    if flags["per_group"]:
        notes.append("--per_group: Kiln's int4 formats always scale per group (--group_size)")
    if flags["disable_weight_only_quant_plugin"]:
        notes.append("--disable_weight_only_quant_plugin: the GEMMs are chosen at build (engine-build --gemm_plugin)")
    # TensorRT-LLM checks INT8 then FP8: with both, FP8 wins.
    kv = "fp8" if flags["fp8_kv_cache"] else "int8" if flags["int8_kv_cache"] else None
    if qformat is None and kv is None and not notes:
        return None
    return Quantization(qformat, kv, alpha, notes)


def _one(current: str | None, wanted: str, flag: str) -> str:
    if current not in (None, wanted):
        raise ConfigError(f"{flag} asks for {wanted}, another flag for {current}: choose one quantization")
    return wanted


def notes(flags: dict) -> list[str]:
    """A line per non-quantization TensorRT-LLM option given; ConfigError for a feature Kiln lacks."""
    out = []
    if flags["meta_ckpt_dir"]:
        raise ConfigError("--meta_ckpt_dir: Meta's original checkpoints (pickled consolidated.*.pth) are not read "
                          "by Kiln; convert the Hugging Face release with --model_dir")
    if flags["cp_size"] != 1:
        raise ConfigError(f"--cp_size {flags['cp_size']}: context parallelism is not supported by Kiln")
    if flags["embedding_sharding_dim"] == "1":
        raise ConfigError("--embedding_sharding_dim 1: Kiln splits the embedding along the vocabulary only (0)")
    if flags["save_config_only"]:
        raise ConfigError("--save_config_only: writing a checkpoint without weights is not supported by Kiln")
    said = {
        "workers": "the ranks' files are written in turn by one process, each tensor read once",
        "load_by_shard": "weights are always read tensor by tensor from the safetensors files",
        "load_model_on_cpu": "Kiln converts on the CPU",
        "use_parallel_embedding": "the embedding is always split along the vocabulary over the tp ranks",
        "embedding_sharding_dim": "the embedding is split along the vocabulary (0)",
        "use_embedding_sharing": "a tied lm_head is written as the embedding's copy; the engine keeps one table",
        "remove_duplicated_kv_heads": "KV heads are replicated only where tp_size exceeds them",
        "max_draft_len": "the tokens drafted per step are speculative_config's num_speculative_tokens, at run time",
        "num_eagle_layers": "Kiln's EAGLE-3 drafts a chain, as deep as speculative_config asks, not an EAGLE-2 tree",
        "max_non_leaves_per_layer": "Kiln's EAGLE-3 drafts a chain, not an EAGLE-2 tree",
    }
    out += [f"--{name}: {text}" for name, text in said.items() if flags[name] not in (None, False)]
    given = [n for n in DUMMY_MODEL if flags[n] is not None]
    if given:
        out.append(f"--{' --'.join(given)}: the model's own config.json decides (these describe a model built "
                   f"without --model_dir)")
    return out
