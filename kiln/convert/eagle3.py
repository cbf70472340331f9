"""convert_checkpoint --eagle_model_dir: an EAGLE-3 draft (kiln/models/eagle3.py), converted beside
its target into the checkpoint's `eagle3/` (engine-build copies it into the engine, which it builds
to return the hidden states the draft reads).

The draft is checked against the target before anything is written; it is written in the target's
dtype with the target's embedding table added when it has none (published drafts read their
target's), and with its target layers named explicitly in config.json. It is one layer: every rank
of a tensor-parallel target runs the same draft, so it is not sharded.
"""
import json
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from kiln.config import ConfigError, PretrainedConfig, torch_dtype
from kiln.convert.hf import HFWeights
from kiln.convert.hf_config import pretrained_config_from_hf
from kiln.convert.shard import HF_EMBED
from kiln.models.eagle3 import (DRAFT_DIR, LAYER_CONFIG, WEIGHTS, check_target, check_tensors, draft_shape,
                                layer_hf_config, read_tensors)
from kiln.utils import replace_dir


def read_draft(draft_dir: Path, target: PretrainedConfig, target_dir: Path) -> tuple[dict, dict]:
    """(its config.json, its tensors with the target's embeddings), checked against the target."""
    path = draft_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"--eagle_model_dir {draft_dir}: no config.json (expected an EAGLE-3 draft directory)")
    hf = json.loads(path.read_text())
    where = f"--eagle_model_dir {draft_dir}"
    shape = draft_shape(hf, target.num_hidden_layers, where)
    check_target(shape, target, where)
    tensors = read_tensors(draft_dir)
    if "embed_tokens.weight" not in tensors:
        with HFWeights(target_dir) as weights:
            tensors["embed_tokens.weight"] = weights.read(HF_EMBED)
    check_tensors(tensors, shape, hf, where)
    if target.mapping.pp_size > 1:
        raise ConfigError(f"{where}: EAGLE-3 with pipeline parallelism (pp_size {target.mapping.pp_size}) is not "
                          f"supported; the draft reads layers of every stage")
    layer = pretrained_config_from_hf(layer_hf_config(hf), "float32", where=path)
    hf = {**hf, "eagle_aux_hidden_state_layer_ids": list(shape.aux_layer_ids), LAYER_CONFIG: layer.to_dict()}
    return hf, tensors


def write_draft(hf: dict, tensors: dict, dtype: str, output_dir: Path) -> None:
    dt = torch_dtype(dtype)
    out = {("midlayer." + k[len("layer."):] if k.startswith("layer.") else k):
           (t.to(dt) if t.is_floating_point() else t).contiguous() for k, t in tensors.items()}
    tmp = Path(tempfile.mkdtemp(prefix=f".{DRAFT_DIR}.", dir=output_dir))
    try:
        save_file(out, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps({**hf, "torch_dtype": dtype}, indent=2) + "\n")
        replace_dir(tmp, output_dir / DRAFT_DIR)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
