"""The Triton LoRA kernels (kiln_gpu::lora_shrink / lora_expand, run on CPU tensors in Triton's
interpreter): TritonAdapters against StepAdapters' dense reference, tokens of the base model (slot -1)
and of adapters of ranks 0, below and at the pools' max mixed in one step."""
import pytest
import torch

from conftest import require
from kiln.config import ConfigError
from kiln.models.lora import StepAdapters

require("triton", "the Triton kernels need triton (pip install 'kiln-llm[gpu]')", module_level=True)

from kiln.plugins.gpu.lora import BLOCK_M, TritonAdapters, lora_shrink  # noqa: E402
from kiln.plugins.gpu.moe import align  # noqa: E402

LAYERS, SLOTS, MAX_RANK, H, Q, KV = 2, 3, 8, 48, 48, 16
RANKS = torch.tensor([8, 0, 5])  # slot 1 empty, slot 2 below the max
SHAPES = {"attn_q": (H, Q), "attn_k": (H, KV), "attn_v": (H, KV), "attn_dense": (Q, H)}


def _pools(g, dtype):
    """(the pools with noise past each slot's rank, as the kernels must ignore it; the same zeroed there)."""
    noisy = {m: torch.randn(LAYERS, SLOTS, MAX_RANK, i + o, generator=g) * 0.3 for m, (i, o) in SHAPES.items()}
    clean = {m: p.clone() for m, p in noisy.items()}
    for p in clean.values():
        for s, r in enumerate(RANKS.tolist()):
            p[:, s, r:] = 0
    return {m: p.to(dtype) for m, p in noisy.items()}, {m: p.to(dtype).float() for m, p in clean.items()}


@pytest.mark.parametrize("dtype,T", [(torch.float32, 1), (torch.float32, 21), (torch.bfloat16, 21)])
def test_triton_adapters_match_step_adapters(dtype, T):
    g = torch.Generator().manual_seed(T)
    noisy, clean = _pools(g, dtype)
    slots = torch.tensor([2] if T == 1 else [-1, 0, 1, 2] * 5 + [0])[torch.randperm(T, generator=g)]
    x, out = torch.randn(T, H, generator=g).to(dtype), torch.randn(T, Q + 2 * KV, generator=g).to(dtype)
    before = out.clone()
    qkv = [("attn_q", 0), ("attn_k", Q), ("attn_v", Q + KV)]
    got = TritonAdapters(slots, RANKS, noisy)(1, out, x, *qkv)
    want = StepAdapters(slots, RANKS, clean, segmented=False)(1, out.float(), x.float(), *qkv)
    assert got.dtype == dtype and torch.equal(out, before)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert (want - before.float()).abs().max() > 0.1
    base = slots == -1  # the base model's tokens and the empty slot's pass through untouched
    assert torch.equal(got[base | (slots == 1)], out[base | (slots == 1)])
    adapters = TritonAdapters(slots, RANKS, {"attn_dense": noisy["attn_dense"]})
    assert adapters(0, out, x, *qkv) is out  # no pool for these modules: nothing to add


def test_lora_shrink_zero_past_rank_and_for_the_base_model():
    g = torch.Generator().manual_seed(0)
    noisy, clean = _pools(g, torch.float32)
    slots = torch.tensor([1, -1, 2, 0, 2])
    x = torch.randn(5, H, generator=g)
    shrunk = lora_shrink(x, noisy["attn_q"][0], RANKS, *align(slots, SLOTS, BLOCK_M))
    a = clean["attn_q"][0][:, :, :H]
    want = torch.stack([x[t] @ a[s].T if s >= 0 else torch.zeros(MAX_RANK) for t, s in enumerate(slots.tolist())])
    torch.testing.assert_close(shrunk, want, atol=1e-5, rtol=1e-5)
    assert shrunk.dtype == torch.float32 and shrunk[2, 5:].abs().max() == 0


def test_lora_kernels_reject_bad_input():
    pools, _ = _pools(torch.Generator().manual_seed(0), torch.float32)
    slots = torch.tensor([0, 1])
    with pytest.raises(ConfigError, match=r"lora_ranks must be integers \[slots\] = \[3\]"):
        lora_shrink(torch.randn(2, H), pools["attn_q"][0], RANKS[:2], *align(slots, SLOTS, BLOCK_M))
    with pytest.raises(ConfigError, match=r"the pool one layer's \[slots, max_rank, in \+ out\]"):
        lora_shrink(torch.randn(2, H + Q), pools["attn_q"][0], RANKS, *align(slots, SLOTS, BLOCK_M))
    with pytest.raises(ConfigError, match="do not fit out's 48 columns"):
        TritonAdapters(slots, RANKS, pools)(0, torch.zeros(2, Q), torch.randn(2, H), ("attn_k", Q - 8))


def test_an_exported_step_keeps_each_kernel_one_node():
    class Step(torch.nn.Module):
        def forward(self, out, x, slots, ranks, pool):
            return TritonAdapters(slots, ranks, {"attn_q": pool})(1, out, x, ("attn_q", 0))

    g = torch.Generator().manual_seed(5)
    noisy, clean = _pools(g, torch.float32)
    slots = torch.tensor([-1, 0, 1, 2, 0, 2, -1])
    args = (torch.randn(7, Q, generator=g), torch.randn(7, H, generator=g), slots, RANKS, noisy["attn_q"])
    T = torch.export.Dim("T", min=1, max=64)
    program = torch.export.export(Step(), tuple(a[:4] if a.shape[0] == 7 else a for a in args),
                                  dynamic_shapes=({0: T}, {0: T}, {0: T}, None, None))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.kiln_gpu.lora_shrink.default) == ops.count(torch.ops.kiln_gpu.lora_expand.default) == 1
    want = StepAdapters(slots, RANKS, {"attn_q": clean["attn_q"]}, segmented=False)(1, args[0], args[1], ("attn_q", 0))
    torch.testing.assert_close(program.module()(*args), want, atol=1e-5, rtol=1e-5)
