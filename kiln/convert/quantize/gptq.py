"""GPTQ settings for ModelOpt's implementation (`mtq` algorithm "gptq").

ModelOpt 0.47's GPTQ is the real algorithm and runs on the CPU: it accumulates each linear's
Hessian H = 2 X^T X from its calibration inputs, damps it by `perc_damp` of its mean diagonal, and
quantizes columns in lazy batches of `block_size` with the Cholesky factor of H^-1, spreading each
column's rounding error over the columns not yet quantized. Scales are fixed beforehand from each
group's max (static groups), so the exported weights sit exactly on their int4 grid. It has no
act-order (columns are taken in their natural order).

Its layer-by-layer mode (`layerwise.enable`, each layer fed the quantized layers' outputs) is off:
in 0.47 on these models it leaves attention.dense exactly at round-to-nearest and makes the MLP
linears worse than round-to-nearest, while the one-pass mode (every Hessian from the unquantized
model's activations) halves round-to-nearest's output error on every linear.
"""
from __future__ import annotations

PERC_DAMP = 0.01


def gptq_algorithm(group_size: int, perc_damp: float = PERC_DAMP) -> dict:
    # ModelOpt requires the lazy-batch width to be a multiple of the quantization group.
    block_size = group_size * max(1, 128 // group_size)
    return {"method": "gptq", "layerwise": {"enable": False}, "perc_damp": perc_damp,
            "block_size": block_size}
