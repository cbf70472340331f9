"""The rotary embedding of a Hugging Face config.json (kiln/convert/hf_config.py reads the rest): rope_theta
and rope_scaling (transformers 4) or rope_parameters (5), partial_rotary_factor, with HF's meaning and every
default filled in."""
from __future__ import annotations

import json
import math

from kiln.config import ConfigError

ROPE_TYPES = {  # rope type -> the keys it reads besides rope_type/type/rope_theta/partial_rotary_factor
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
    # Phi-3's only (transformers 4's Phi3Config refuses factor and attention_factor beside them)
    "longrope": {"short_factor", "long_factor", "original_max_position_embeddings"},
}
# Rope types transformers implements and Kiln refuses (tests fail on a type in neither table).
REFUSED_ROPE_TYPES = ("proportional",)
# Phi-3's default original_max_position_embeddings (a Phi3Config attribute in both majors).
PHI3_ORIGINAL_MAX_POSITIONS = 4096
_ROPE_REQUIRED = {"linear": {"factor"}, "dynamic": {"factor"},
                  "llama3": {"factor", "low_freq_factor", "high_freq_factor"}, "yarn": {"factor"},
                  "longrope": {"short_factor", "long_factor"}}


def rope_of(hf: dict, max_pos: int, default_theta: float, phi3: bool = False) -> tuple[float, dict | None, float]:
    """rotary_base, rotary_scaling and partial_rotary_factor, as HF computes them from either schema.
    LongRoPE and partial rotary are read for Phi-3 only (the other families' HF attention has neither)."""
    legacy, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    for key, value in (("rope_scaling", legacy), ("rope_parameters", params)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{key} must be an object or null, got {value!r}")
    params = _one_rope_for_all_layers(params, hf.get("layer_types"))
    if legacy and params and _strip_theta(legacy) != _strip_theta(params):
        raise ConfigError(f"rope_scaling {legacy} and rope_parameters {params} disagree; expected one of "
                          f"them (transformers 4 reads rope_scaling, 5 rope_parameters)")
    rope = dict(legacy or params or {})

    top_theta, dict_theta = hf.get("rope_theta"), rope.pop("rope_theta", None)
    if top_theta is not None and dict_theta is not None and float(top_theta) != float(dict_theta):
        raise ConfigError(f"rope_theta {top_theta} and the rope dict's rope_theta {dict_theta} disagree; "
                          f"expected one value (transformers 4 reads the first, 5 the second)")
    theta = float(next(t for t in (dict_theta, top_theta, default_theta) if t is not None))

    kinds = {rope.pop(k) for k in ("rope_type", "type") if k in rope}
    if len(kinds) > 1:
        raise ConfigError(f"the rope dict's type and rope_type disagree ({', '.join(sorted(kinds))})")
    kind = kinds.pop() if kinds else "default"
    partial = _partial_rotary_factor(hf.get("partial_rotary_factor"), rope.pop("partial_rotary_factor", None), phi3)
    if kind == "longrope" and not phi3:
        raise ConfigError("rope_type 'longrope' is supported for Phi3ForCausalLM only (the other families' HF "
                          "attention does not switch factors)")
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_type {kind!r} is not supported; expected one of {', '.join(ROPE_TYPES)}")
    unknown = sorted(set(rope) - ROPE_TYPES[kind])
    if unknown:
        raise ConfigError(f"rope {kind} key(s) {', '.join(unknown)} are not understood; expected only "
                          f"{', '.join(sorted(ROPE_TYPES[kind])) or 'rope_theta'}")
    # yarn's factor may be null (transformers 5 then takes the ratio of the context lengths)
    missing = sorted(k for k in _ROPE_REQUIRED.get(kind, ())
                     if k not in rope or (rope[k] is None and (kind, k) != ("yarn", "factor")))
    if missing:
        raise ConfigError(f"rope {kind} is missing {', '.join(missing)}")
    if kind == "default":
        return theta, None, partial
    if kind in ("llama3", "yarn"):
        rope["original_max_position_embeddings"] = _original_max_pos(hf, rope, kind, max_pos)
    if kind == "yarn":
        rope = _yarn(rope, max_pos)
    if kind == "longrope":
        rope = _longrope(hf, rope, max_pos)
    return theta, {"type": kind, **rope}, partial


def _partial_rotary_factor(top, inner, phi3: bool) -> float:
    # transformers 4 reads the top-level key, 5 the rope dict's (into which it copies the top-level one)
    for where, factor in (("", top), ("the rope dict's ", inner)):
        if factor is None:
            continue
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
            raise ConfigError(f"{where}partial_rotary_factor {factor!r} is not supported; expected a number "
                              f"in (0, 1]")
        if not phi3 and factor != 1:
            raise ConfigError(f"{where}partial_rotary_factor {factor} is not supported; expected 1.0 "
                              f"(rotary embedding over the whole head)")
    if top is not None and inner is not None and float(top) != float(inner):
        raise ConfigError(f"partial_rotary_factor {top} and the rope dict's {inner} disagree; expected one value "
                          f"(transformers 4 reads the first, 5 the second)")
    return float(next((f for f in (top, inner) if f is not None), 1.0))


def _longrope(hf: dict, rope: dict, max_pos: int) -> dict:
    """Phi-3's LongRoPE: short factors for a sequence up to original_max_position_embeddings, long ones
    past it, and cos/sin times sqrt(1 + ln(s) / ln(original)), s = max_position_embeddings / original."""
    top, inner = hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")
    original = PHI3_ORIGINAL_MAX_POSITIONS if top is None else top  # both majors: the top level, else 4096
    if inner is not None and inner != original:
        raise ConfigError(f"original_max_position_embeddings is {inner} in the rope dict but {original} at the top "
                          f"level{' (by default)' if top is None else ''}; expected them equal (HF reads the "
                          f"top-level one)")
    if isinstance(original, bool) or not isinstance(original, int) or original < 1:
        raise ConfigError(f"original_max_position_embeddings {original!r} is not supported; expected an integer >= 1")
    for key in ("short_factor", "long_factor"):
        factors = rope[key]
        if not isinstance(factors, list) or not all(
                isinstance(f, (int, float)) and not isinstance(f, bool) and f > 0 for f in factors):
            raise ConfigError(f"rope longrope {key} {factors!r} is not supported; expected a list of positive numbers")
    scale = max_pos / original
    attention_factor = 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))
    return {"short_factor": [float(f) for f in rope["short_factor"]],
            "long_factor": [float(f) for f in rope["long_factor"]],
            "original_max_position_embeddings": original, "attention_factor": attention_factor}


def _one_rope_for_all_layers(params: dict | None, layer_types: list | None) -> dict | None:
    # transformers 5 may key rope_parameters by layer type ({"full_attention": {...}, ...}).
    if not params or not layer_types or not set(params) <= set(layer_types):
        return params
    distinct = {json.dumps(params[t], sort_keys=True) for t in set(layer_types)}
    if len(distinct) > 1:
        raise ConfigError(f"rope_parameters differ between layer types ({', '.join(sorted(params))}); "
                          f"expected one rotary embedding for every layer")
    return params[layer_types[0]]


def _strip_theta(rope: dict) -> dict:
    out = {k: v for k, v in rope.items() if k not in ("rope_theta", "type", "rope_type")}
    out["type"] = rope.get("rope_type", rope.get("type", "default"))
    return out


def _original_max_pos(hf: dict, rope: dict, kind: str, max_pos: int) -> int:
    # transformers 5 takes a top-level original_max_position_embeddings over the rope dict's;
    # transformers 4 reads only the rope dict's (yarn: else max_position_embeddings).
    top, inner = hf.get("original_max_position_embeddings"), rope.get("original_max_position_embeddings")
    v5 = next((v for v in (top, inner) if v is not None), max_pos)
    v4 = inner if inner is not None else (max_pos if kind == "yarn" else v5)
    if v4 != v5:
        raise ConfigError(f"original_max_position_embeddings is {top} at the top level but "
                          f"{inner if inner is not None else f'absent (so {max_pos})'} in the rope dict; "
                          f"expected them equal (transformers 4 and 5 read different ones)")
    return int(v5)


def _yarn(rope: dict, max_pos: int) -> dict:
    """HF's YaRN parameters with every default filled in, so the checkpoint says what it computes."""
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor")
    if factor is None:  # DeepSeek-style: the ratio of the context lengths (transformers 5)
        factor = max_pos / original
    factor = float(factor)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    truncate = rope.get("truncate", True)
    return {"factor": factor, "original_max_position_embeddings": original,
            "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
            "truncate": True if truncate is None else bool(truncate),
            "attention_factor": float(attention_factor)}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
