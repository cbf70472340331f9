"""The repository's parameters: TensorRT-LLM's keys and `fill_template.py` placeholder names, each
with its type, default and check. `kiln triton-repo --param`, `--check` and the models at load all
read values through `parse`, so a bad value gets the same one-line message wherever it is found."""
import math
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.config import ConfigError, EngineConfig


PLACEHOLDER = re.compile(r"\$\{([^}]*)\}")


class ParamError(ValueError):
    pass


@dataclass(frozen=True)
class Param:
    kind: str  # "path", "int", "float", "bool" or "choice"
    default: str | None  # None: required; "" : unset (the engine's own default)
    help: str
    minimum: float | None = None
    choices: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.kind == "int":
            return f"an integer >= {self.minimum:g}"
        if self.kind == "float":
            return "a number in (0, 1]"
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return " or ".join(self.choices)
        return "an existing directory"


def _int(minimum: int, default: str | None, help: str) -> Param:
    return Param("int", default, help, minimum=minimum)


def _bool(default: str, help: str) -> Param:
    return Param("bool", default, help)


# Every `${name}` the templates hold, and nothing else (tests/test_triton.py checks both ways).
PARAMETERS: dict[str, Param] = {
    # tensorrt_llm
    "gpt_model_path": Param("path", None, "the engine dir (default: --engine_dir)"),
    "gpt_model_type": Param("choice", "inflight_fused_batching", "batching: in-flight (V1 static batching "
                            "is refused)", choices=("inflight_fused_batching", "inflight_batching")),
    "batch_scheduler_policy": Param("choice", "guaranteed_no_evict", "admission: reserve KV blocks for the "
                                    "whole sequence, or fill the batch and preempt",
                                    choices=("guaranteed_no_evict", "max_utilization")),
    "max_tokens_in_paged_kv_cache": _int(1, "", "KV cache size in tokens (empty: from memory)"),
    "kv_cache_free_gpu_mem_fraction": Param("float", "", "fraction of free memory for the KV cache "
                                            "(empty: enough for every slot at full length)"),
    "enable_chunked_context": _bool("false", "prefill long prompts in chunks beside running requests"),
    # On when unset, as the engine's own default and tensorrtllm_backend's since its executor-API
    # rewrite (its GptManager-era versions defaulted to false)
    "enable_kv_cache_reuse": _bool("true", "prefix caching: reuse the KV blocks of prompt prefixes seen before"),
    # TensorRT-LLM's: "eagle" speculates with the engine's EAGLE-3 draft (num_speculative_tokens "auto"); the
    # sampling modes are every request's own choice here
    "decoding_mode": Param("choice", "auto", "eagle: EAGLE-3 speculative decoding with the engine's draft",
                           choices=("auto", "top_k", "top_p", "top_k_top_p", "beam_search", "eagle")),
    "exclude_input_in_output": _bool("false", "output_ids without the prompt (a request may override)"),
    "max_beam_width": _int(1, "1", "widest beam_width a request may send (at most the engine's max_beam_width)"),
    "cancellation_check_period_ms": _int(1, "100", "how often cancelled requests are looked for"),
    "stats_check_period_ms": _int(1, "100", "how often the engine's metrics are updated"),
    # preprocessing / postprocessing
    "tokenizer_dir": Param("path", None, "the tokenizer (default: the engine dir)"),
    "add_special_tokens": _bool("true", "preprocessing: encode text_input with the tokenizer's special tokens"),
    "skip_special_tokens": _bool("true", "postprocessing: leave special tokens out of text_output"),
    # every model
    "triton_max_batch_size": _int(1, None, "Triton's max_batch_size (default: the engine's)"),
    "decoupled_mode": _bool("true", "decoupled models: streaming and several responses per request"),
    "max_queue_delay_microseconds": _int(0, "0", "Triton's dynamic batching delay"),
    "bls_instance_count": _int(1, "1", "instances of tensorrt_llm_bls"),
    "preprocessing_instance_count": _int(1, "1", "instances of preprocessing"),
    "postprocessing_instance_count": _int(1, "1", "instances of postprocessing"),
}

REFUSED_VALUES = {
    ("gpt_model_type", "v1"): "V1 (static batching) is not supported: use inflight_fused_batching",
}
BOOLS = {"true": "true", "1": "true", "false": "false", "0": "false"}


def parse(name: str, value: str):
    """The typed value of a parameter (None for an unset optional one); ParamError otherwise."""
    spec = PARAMETERS.get(name)
    if spec is None:
        raise ParamError(f"unknown parameter {name!r}; expected one of: {', '.join(PARAMETERS)}")
    if not isinstance(value, str):
        raise ParamError(f"parameter {name}: expected a string value, got {value!r}")
    if "${" in value:
        raise ParamError(f"parameter {name}: {value!r} was never filled in (a leftover ${{...}} placeholder)")
    text = value.strip()
    refused = REFUSED_VALUES.get((name, BOOLS.get(text.lower(), text.lower())))
    if refused:
        raise ParamError(f"parameter {name}: {refused}")
    if text == "" and spec.default == "":
        return None
    bad = ParamError(f"parameter {name}: expected {spec.describe()}, got {value!r}")
    if spec.kind == "bool":
        if text.lower() not in BOOLS:
            raise bad
        return BOOLS[text.lower()] == "true"
    if spec.kind == "int":
        try:
            number = int(text)
        except ValueError:
            raise bad from None
        if number < spec.minimum:
            raise bad
        return number
    if spec.kind == "float":
        try:
            number = float(text)
        except ValueError:
            raise bad from None
        if not (math.isfinite(number) and 0 < number <= 1):
            raise bad
        return number
    if spec.kind == "choice":
        if text not in spec.choices:
            raise bad
        return text
    path = Path(text)
    if not text or not path.is_absolute():
        raise ParamError(f"parameter {name}: expected an absolute path, got {value!r}")
    if not path.is_dir():
        raise ParamError(f"parameter {name}: {value!r} is not a directory")
    if name == "gpt_model_path":
        try:
            EngineConfig.load(path)
        except (ConfigError, OSError, ValueError) as e:
            raise ParamError(f"parameter gpt_model_path: {e}") from None
    if name == "tokenizer_dir" and not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        raise ParamError(f"parameter tokenizer_dir: {value!r} has no tokenizer (tokenizer.json or "
                         "tokenizer_config.json)")
    return str(path)


def read(model_parameters: dict, names: list[str]) -> dict:
    """A model's own parameters from its config (`{"key": {"string_value": ...}}`), parsed; an
    absent optional parameter takes its default."""
    out = {}
    for name in names:
        entry = model_parameters.get(name)
        if entry is None:
            if PARAMETERS[name].default is None:
                raise ParamError(f"parameter {name} is missing from config.pbtxt")
            value = PARAMETERS[name].default
        else:
            value = entry.get("string_value", "") if isinstance(entry, dict) else entry
        out[name] = parse(name, value)
    return out
