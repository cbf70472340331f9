"""Writes a model repository from the templates (`kiln triton-repo`) and checks one (`--check`).

The templates (`templates/inflight_batcher_llm`) are a repository with `${name}` placeholders, like
tensorrtllm_backend's `all_models/inflight_batcher_llm`: `kiln triton-repo` fills them from the engine
and `--param`s, or a user fills a copy with TensorRT-LLM's `tools/fill_template.py`. Either way
`check_repository` names every problem, with the messages the models give at load."""
import re
import shutil
import string
import tempfile
from pathlib import Path

from kiln.config import EngineConfig
from kiln.triton_backend import upstream
from kiln.triton_backend.parameters import PARAMETERS, PLACEHOLDER, ParamError, parse, read

TEMPLATE_ROOT = Path(__file__).parent / "templates"
TEMPLATES = TEMPLATE_ROOT / "inflight_batcher_llm"
LAYOUTS = ("inflight_batcher_llm", "llmapi")
# The parameters the llmapi layout takes (the rest are its preprocessing/postprocessing/BLS's);
# they become model.yaml's keys (LLMAPI_YAML) or config.pbtxt's decoupled.
LLMAPI_PARAMETERS = ("gpt_model_path", "tokenizer_dir", "batch_scheduler_policy", "max_tokens_in_paged_kv_cache",
                     "kv_cache_free_gpu_mem_fraction", "enable_chunked_context", "enable_kv_cache_reuse",
                     "cancellation_check_period_ms", "decoupled_mode")
PYTHON_MODELS = ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")
MODELS = PYTHON_MODELS + ("ensemble",)
MODEL_PARAMETERS = {
    "tensorrt_llm": ["gpt_model_path", "gpt_model_type", "batch_scheduler_policy", "max_tokens_in_paged_kv_cache",
                     "kv_cache_free_gpu_mem_fraction", "enable_chunked_context", "enable_kv_cache_reuse",
                     "exclude_input_in_output", "max_beam_width", "cancellation_check_period_ms",
                     "stats_check_period_ms"],
    "preprocessing": ["tokenizer_dir", "add_special_tokens"],
    "postprocessing": ["tokenizer_dir", "skip_special_tokens"],
}


def resolve(engine_dir, overrides: dict[str, str]) -> dict[str, str]:
    """Every parameter's value as written into config.pbtxt: the defaults (from the engine where
    TensorRT-LLM's come from the user) under the overrides, each checked. ParamError names all
    problems, in one line."""
    engine_dir = Path(engine_dir).resolve()
    values = {name: p.default for name, p in PARAMETERS.items()}
    values.update(gpt_model_path=str(engine_dir), tokenizer_dir=str(engine_dir))
    try:
        build = EngineConfig.load(engine_dir).build_config
    except Exception as e:  # noqa: BLE001 - reported as the engine dir's problem
        raise ParamError(f"--engine_dir {engine_dir}: {e}") from None
    values.update(triton_max_batch_size=str(build.max_batch_size), max_beam_width=str(build.max_beam_width))
    problems = []
    for name, value in overrides.items():
        if name not in PARAMETERS:
            problems.append(f"unknown parameter {name!r}")
            continue
        if PARAMETERS[name].kind == "path" and value.strip():
            value = str(Path(value.strip()).expanduser().resolve())
        values[name] = value
    for name, value in values.items():
        if name not in PARAMETERS:
            continue
        if any(c in value for c in '"\\\n'):
            problems.append(f"parameter {name}: {value!r} cannot be written into config.pbtxt (quote, backslash "
                            "or newline)")
            continue
        try:
            typed = parse(name, value)
        except ParamError as e:
            problems.append(str(e))
            continue
        if isinstance(typed, bool):
            values[name] = "true" if typed else "false"
        if name == "max_beam_width" and typed > build.max_beam_width:
            problems.append(f"parameter max_beam_width: {typed} exceeds the engine's max_beam_width "
                            f"({build.max_beam_width}); rebuild it with engine-build --max_beam_width {typed}")
    if problems:
        if any(p.startswith("unknown") for p in problems):
            problems.append(f"the parameters are: {', '.join(PARAMETERS)}")
        raise ParamError("; ".join(problems))
    return values


def llmapi_yaml(values: dict[str, str]) -> dict:
    """model.yaml of the llmapi layout: the LLM API's names for the resolved parameters."""
    kv = {"enable_block_reuse": values["enable_kv_cache_reuse"] == "true"}
    if values["kv_cache_free_gpu_mem_fraction"]:
        kv["free_gpu_memory_fraction"] = float(values["kv_cache_free_gpu_mem_fraction"])
    if values["max_tokens_in_paged_kv_cache"]:
        kv["max_tokens"] = int(values["max_tokens_in_paged_kv_cache"])
    cfg = {"model": values["gpt_model_path"]}
    if values["tokenizer_dir"] != values["gpt_model_path"]:
        cfg["tokenizer"] = values["tokenizer_dir"]
    cfg.update(enable_chunked_prefill=values["enable_chunked_context"] == "true", kv_cache_config=kv,
               scheduler_config={"capacity_scheduler_policy": values["batch_scheduler_policy"].upper()},
               triton_config={"max_batch_size": 0, "decoupled": values["decoupled_mode"] == "true",
                              "cancellation_check_period_ms": int(values["cancellation_check_period_ms"])})
    return cfg


def write_repository(engine_dir, output_dir, overrides: dict[str, str], overwrite: bool = False,
                     layout: str = "inflight_batcher_llm") -> Path:
    """Fill the layout's templates into a temporary sibling of output_dir, check it, and rename it
    into place; nothing is written unless every parameter is good."""
    if layout not in LAYOUTS:
        raise ParamError(f"--layout {layout!r}: expected {' or '.join(LAYOUTS)}")
    if layout == "llmapi":
        other = [name for name in overrides if name in PARAMETERS and name not in LLMAPI_PARAMETERS]
        if other:
            raise ParamError(f"parameter(s) {', '.join(other)} are for the inflight_batcher_llm layout; the llmapi "
                             f"layout takes {', '.join(LLMAPI_PARAMETERS)}")
    values = resolve(engine_dir, overrides)
    out = Path(output_dir).expanduser().resolve()
    for name in ("gpt_model_path", "tokenizer_dir"):
        used = Path(values[name])
        if used == out or out in used.parents or used in out.parents:
            raise ParamError(f"--output_dir {out} overlaps {name} {used}: the repository is replaced as a "
                             "whole; write it elsewhere")
    if out.exists() and not out.is_dir():
        raise ParamError(f"--output_dir {out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise ParamError(f"--output_dir {out} exists and is not empty; pass --overwrite to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    templates = TEMPLATE_ROOT / layout
    try:
        for src in sorted(templates.rglob("*")):
            dst = tmp / src.relative_to(templates)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
            elif src.name == "config.pbtxt":
                dst.write_text(string.Template(src.read_text()).substitute(values))
            elif src.name == "model.py":
                shutil.copyfile(src, dst)
        if layout == "llmapi":
            import yaml

            (tmp / "tensorrt_llm" / "1" / "model.yaml").write_text(
                "# The engine and its runtime options, by the LLM API's names (see README.md, Triton).\n"
                + yaml.safe_dump(llmapi_yaml(values), sort_keys=False))
        problems = check_repository(tmp)
        if problems:  # a template bug: never leave a repository Triton would refuse
            raise ParamError(f"the written repository does not check: {problems[0]}")
        if out.exists():
            old = out.with_name(f".{out.name}.old-{tmp.name.rsplit('-', 1)[-1]}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def check_repository(repo) -> list[str]:
    """Every problem of a repository (ours, one filled by hand from the templates, or one whose
    tensorrt_llm was written for TensorRT-LLM's own backend); [] if none. A repository may hold any
    of the layout's models; the ensemble needs its steps."""
    repo = Path(repo)
    if not repo.is_dir():
        return [f"{repo} is not a directory"]
    if (repo / "tensorrt_llm" / "1" / "model.yaml").is_file() and not (repo / "ensemble").exists():
        return _check_llmapi(repo)
    present = [m for m in MODELS if (repo / m / "config.pbtxt").is_file()]
    if not present:
        return [f"{repo} holds none of the models {', '.join(MODELS)} (each a folder with a config.pbtxt)"]
    problems, configs = [], {}
    for model in present:
        text = (repo / model / "config.pbtxt").read_text()
        left = [(i, m.group(1)) for i, line in enumerate(text.splitlines(), 1) for m in PLACEHOLDER.finditer(line)]
        upstream_backend = model == "tensorrt_llm" and re.search(rf'^\s*backend:\s*"{upstream.BACKEND}"', text, re.M)
        if not upstream_backend:  # TensorRT-LLM's backend reads a leftover placeholder as unset
            for line, name in left:
                hint = f"`--param {name}=...`" if name in PARAMETERS else "a value"
                problems.append(f"{model}/config.pbtxt:{line}: ${{{name}}} was never filled in (give it {hint})")
            if left:
                continue
        try:
            configs[model] = config = _parse_config(text)
        except ValueError as e:
            problems.append(f"{model}/config.pbtxt: not a valid model configuration: {e}")
            continue
        problems += _check_model(repo, model, config)
    sizes = {m: c.max_batch_size for m, c in configs.items()}
    if len(set(sizes.values())) > 1:
        problems.append(f"max_batch_size differs between models: {sizes} (one triton_max_batch_size for all)")
    modes = {m: configs[m].model_transaction_policy.decoupled for m in ("tensorrt_llm", "tensorrt_llm_bls")
             if m in configs}
    if len(set(modes.values())) > 1:
        problems.append(f"decoupled differs between tensorrt_llm and tensorrt_llm_bls: {modes} (one decoupled_mode)")
    if "ensemble" in configs:
        steps = [s.model_name for s in configs["ensemble"].ensemble_scheduling.step]
        if steps != ["preprocessing", "tensorrt_llm", "postprocessing"]:
            problems.append(f"ensemble/config.pbtxt: steps are {steps}, expected preprocessing, tensorrt_llm, "
                            "postprocessing")
        problems += [f"{m}/config.pbtxt is missing (a step of the ensemble)" for m in steps if m not in present]
    return problems


def _check_model(repo: Path, model: str, config) -> list[str]:
    problems = []
    if config.name and config.name != model:
        problems.append(f"{model}/config.pbtxt: name is {config.name!r}, expected {model!r}")
    if not (repo / model / "1").is_dir():
        problems.append(f"{model}/1/ is missing (Triton needs the version directory)")
    if any(g.kind == g.KIND_GPU for g in config.instance_group):
        problems.append(f"{model}/config.pbtxt: instance_group kind KIND_GPU needs a GPU, and Kiln's engines run on "
                        f"the CPU: use KIND_CPU (or leave instance_group out)")
    params = {k: {"string_value": v.string_value} for k, v in config.parameters.items()}
    try:
        if model == "tensorrt_llm" and config.backend == upstream.BACKEND:
            upstream.read_parameters(params, MODEL_PARAMETERS[model])
            return problems
        if model in PYTHON_MODELS and not (repo / model / "1" / "model.py").is_file():
            problems.append(f"{model}/1/model.py is missing")
        read(params, MODEL_PARAMETERS.get(model, []))
    except ParamError as e:
        problems.append(f"{model}/config.pbtxt: {e}")
    return problems


def needs_auto_complete(repo) -> bool:
    """Whether a model of the repository leaves its inputs or outputs to Triton's auto-complete (as
    configs written for TensorRT-LLM's own backend may)."""
    for path in Path(repo).glob("*/config.pbtxt"):
        try:
            config = _parse_config(path.read_text())
        except ValueError:
            return True
        if not config.HasField("ensemble_scheduling") and not (config.input and config.output):
            return True
    return False


def _check_llmapi(repo: Path) -> list[str]:
    from kiln.triton_backend.llmapi_io import ModelYamlError, read_model_yaml

    model, problems = repo / "tensorrt_llm", []
    for name in ("config.pbtxt", "1/model.py"):
        if not (model / name).is_file():
            problems.append(f"tensorrt_llm/{name} is missing")
    try:
        cfg = read_model_yaml(model / "1" / "model.yaml")
    except ModelYamlError as e:
        problems.append(str(e))
        cfg = None
    if problems:
        return problems
    try:
        config = _parse_config((model / "config.pbtxt").read_text())
    except ValueError as e:
        return [f"tensorrt_llm/config.pbtxt: not a valid model configuration: {e}"]
    if config.name != "tensorrt_llm":
        problems.append(f"tensorrt_llm/config.pbtxt: name is {config.name!r}, expected 'tensorrt_llm'")
    for key, pbtxt, yaml_value in (("max_batch_size", config.max_batch_size, cfg.max_batch_size),
                                   ("decoupled", config.model_transaction_policy.decoupled, cfg.decoupled)):
        if pbtxt != yaml_value:
            problems.append(f"tensorrt_llm: {key} is {pbtxt} in config.pbtxt but {yaml_value} in model.yaml's "
                            "triton_config; they must agree")
    return problems


def _parse_config(text: str):
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise ValueError("checking needs tritonclient: pip install 'kiln-llm[triton]'") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise ValueError(str(e)) from None
