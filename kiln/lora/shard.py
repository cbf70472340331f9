"""An adapter's share on each rank of an engine: its layers of the rank's pipeline stage, split over
the tensor-parallel ranks as the linears they adapt (kiln/models/lora.py)."""
import torch

from kiln.config import PretrainedConfig, torch_dtype
from kiln.layout import kv_head_range
from kiln.lora.adapter import Adapter, check_adapter
from kiln.models.lora import ROW_PARALLEL, module_shapes


def rank_weights(adapter: Adapter, config: PretrainedConfig, lora_config: dict, rank: int
                 ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's weights for rank `rank` of the engine: module -> [(A, B) for each layer of the
    rank's pipeline stage, None where the adapter leaves the layer alone], in the model's dtype."""
    check_adapter(adapter, config, lora_config)
    dtype, tp_rank = torch_dtype(config.dtype), config.mapping.tp_rank(rank)
    layers = config.layers_of(config.mapping.pp_rank(rank))
    out = {}
    for module in adapter.modules:
        out[module] = []
        for layer in layers:
            pair = adapter.weights.get((layer, module))
            if pair is not None:
                a, b = _split(config, module, *pair, tp_rank)
                pair = a.to(dtype), b.to(dtype)
            out[module].append(pair)
    return out


def _split(config: PretrainedConfig, module: str, a: torch.Tensor, b: torch.Tensor, tp_rank: int):
    """A's input columns of a row-parallel module, B's output rows of a column-parallel one: the rows
    the rank's checkpoint holds of the base linear's output (kiln/layout.py)."""
    tp = config.mapping.tp_size
    if tp == 1:
        return a, b
    if module in ROW_PARALLEL:
        part = a.shape[1] // tp
        return a[:, tp_rank * part:(tp_rank + 1) * part], b
    if module in ("attn_k", "attn_v"):
        heads = kv_head_range(config, tp_rank)
        return a, b[heads.start * config.head_size:heads.stop * config.head_size]
    rows = module_shapes(config)[module][1]
    return a, b[tp_rank * rows:(tp_rank + 1) * rows]
