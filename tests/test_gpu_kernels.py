"""The Triton kernels of the GPU op set (kiln/plugins/gpu) against the plain-torch spec
(kiln/plugins/reference.py), run on CPU tensors in Triton's interpreter (conftest sets
TRITON_INTERPRET=1). Small shapes; every dtype, GQA ratio, block size, window, soft cap and 8-bit
pool the model's layers use."""
import random

import pytest
import torch

from conftest import require

require("triton", "OpenAI Triton is not installed (pip install 'kiln-llm[gpu]')", module_level=True)

from kiln.plugins import cpu, reference  # noqa: E402
from kiln.plugins.gpu import attention, elementwise  # noqa: E402

FP8 = torch.float8_e4m3fn
# One bfloat16 ulp: the interpreter rounds float32 to bfloat16 its own way
TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2, torch.float16: 4e-3}


def close(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_rotary_and_gated_activations(dtype):
    torch.manual_seed(0)
    x, residual, w = torch.randn(7, 40, dtype=dtype), torch.randn(7, 40, dtype=dtype), torch.randn(40, dtype=dtype)
    close(elementwise.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6), dtype)
    for got, want in zip(elementwise.fused_add_rms_norm(x, residual, w, 1e-5),
                         reference.fused_add_rms_norm(x, residual, w, 1e-5)):
        close(got, want, dtype)
    # q and k as head views of one fused QKV row (strided, not copied); Qwen3's per-head norm on them
    qkv = torch.randn(7, (4 + 2 + 2) * 16, dtype=dtype)
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    close(elementwise.rms_norm(q, w[:16], 1e-6), reference.rms_norm(q, w[:16], 1e-6), dtype)
    for rotary in (8, 6):  # full, and partial (Phi-style): the last 4 dims pass through
        cos, sin = torch.randn(7, rotary), torch.randn(7, rotary)
        for got, want in zip(elementwise.rotary_embedding(q, k, cos, sin), reference.rotary_embedding(q, k, cos, sin)):
            close(got, want, dtype)
    gated = torch.randn(7, 2 * 37, dtype=dtype)
    close(elementwise.silu_and_mul(gated), reference.silu_and_mul(gated), dtype)
    close(elementwise.gelu_tanh_and_mul(gated), cpu.gelu_tanh_and_mul(gated.float()).to(dtype), dtype)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float16, FP8, torch.int8])
def test_kv_write_matches_the_spec_bit_for_bit(kv_dtype):
    torch.manual_seed(1)
    kv, scale = torch.zeros(2, 2, 6, 16, 2, 16, dtype=kv_dtype), None
    if kv_dtype in (FP8, torch.int8):
        scale = torch.tensor(0.02)  # values past the 8-bit range saturate
    k, v = torch.randn(20, 2, 16) * 3, torch.randn(20, 2, 16)
    if scale is None:  # a float pool holds the model's dtype (the interpreter's own float32 rounding aside)
        k, v = k.to(kv_dtype), v.to(kv_dtype)
    slots = torch.randperm(6 * 16)[:20]
    want = kv.clone()
    reference.kv_cache_write(want, 1, k, v, slots, scale)
    attention.kv_cache_write(kv, 1, k, v, slots, scale)
    assert torch.equal(kv.view(torch.uint8) if kv.itemsize == 1 else kv, want.view(torch.uint8) if kv.itemsize == 1
                       else want)


def _step(dtype, kv_dtype, heads, kv_heads, head_size, block_size, contexts, window=0, seed=0):
    """A mixed step over a shuffled pool: contexts is [(length, new tokens)], 1 new token meaning a
    decode. Pages wholly behind a window are -1, as the KV cache manager leaves them."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks = sum(-(-n // block_size) for n, _ in contexts)
    free = list(range(blocks + 3))
    rng.shuffle(free)
    kv = torch.zeros(2, 2, blocks + 3, block_size, kv_heads, head_size, dtype=kv_dtype)
    scale = torch.tensor(0.03) if kv_dtype in (FP8, torch.int8) else None
    tables = []
    for length, _ in contexts:
        table = [free.pop() for _ in range(-(-length // block_size))]
        k = torch.randn(length, kv_heads, head_size, generator=gen).to(dtype)
        v = torch.randn(length, kv_heads, head_size, generator=gen).to(dtype)
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(length)])
        reference.kv_cache_write(kv, 1, k, v, slots, scale)
        tables.append(table)
    ctx = [i for i, (_, new) in enumerate(contexts) if new > 1]
    dec = [i for i, (_, new) in enumerate(contexts) if new == 1]
    T = sum(contexts[i][1] for i in ctx) + len(dec)
    # q as the head view of a wider row, as the model's QKV split hands it over
    q = torch.randn(T, heads * head_size + 8, generator=gen).to(dtype)[:, :heads * head_size].view(T, heads, head_size)
    width = max(len(t) for t in tables)

    def table_rows(ids, queries):
        rows = torch.full((len(ids), width), -1, dtype=torch.int32)
        for r, i in enumerate(ids):
            length = contexts[i][0]
            first = max(0, length - queries[r] - window + 1) // block_size if window else 0
            rows[r, first:len(tables[i])] = torch.tensor(tables[i][first:], dtype=torch.int32)
        return rows

    news = [contexts[i][1] for i in ctx]
    ctx_index = torch.full((len(ctx), max(news, default=1)), -1, dtype=torch.long)
    start = 0
    for r, n in enumerate(news):
        ctx_index[r, :n] = torch.arange(start, start + n)
        start += n
    pages = (ctx_index, table_rows(ctx, news), torch.tensor([contexts[i][0] for i in ctx], dtype=torch.int32),
             torch.arange(start, T), table_rows(dec, [1] * len(dec)),
             torch.tensor([contexts[i][0] for i in dec], dtype=torch.int32))
    return q, kv, pages, scale


CASES = [  # dtype, kv dtype, heads, KV heads, head size, block size, (context length, new tokens)..., window, cap
    (torch.float32, torch.float32, 4, 4, 16, 16, [(1, 1), (17, 17), (300, 40), (300, 1)], 0, 0.0),  # MHA
    (torch.float32, torch.float32, 8, 2, 32, 32, [(17, 1), (40, 5), (300, 1)], 0, 0.0),  # GQA 4
    (torch.bfloat16, torch.bfloat16, 8, 1, 16, 16, [(17, 17), (1, 1), (300, 1)], 0, 0.0),  # GQA 8
    (torch.float32, torch.float32, 8, 2, 16, 16, [(300, 30), (300, 1), (17, 1)], 20, 30.0),  # window, soft cap
    (torch.bfloat16, torch.bfloat16, 4, 1, 64, 32, [(300, 17), (40, 1)], 0, 50.0),  # Gemma 2's cap, D 64
    (torch.float32, FP8, 4, 2, 16, 16, [(17, 17), (300, 1)], 0, 0.0),
    (torch.bfloat16, torch.int8, 8, 2, 16, 32, [(300, 9), (17, 1)], 16, 0.0),
    (torch.float32, torch.float32, 4, 2, 8, 4, [(9, 9), (7, 1)], 0, 0.0),  # pages smaller than a tile, D 8
]


@pytest.mark.parametrize("dtype,kv_dtype,heads,kv_heads,head_size,block_size,contexts,window,softcap", CASES)
def test_paged_attention_matches_the_spec(dtype, kv_dtype, heads, kv_heads, head_size, block_size, contexts, window,
                                          softcap):
    q, kv, pages, scale = _step(dtype, kv_dtype, heads, kv_heads, head_size, block_size, contexts, window)
    got = attention.paged_attention(q, kv, 1, *pages, head_size ** -0.5, scale, window=window, softcap=softcap)
    # The spec reads every page (the -1 pages behind the window are masked out by it anyway)
    spec_pages = tuple(p.clamp(min=0) if p.dtype == torch.int32 and p.dim() == 2 else p for p in pages)
    want = reference.paged_attention(q, kv, 1, *spec_pages, head_size ** -0.5, scale, window=window, softcap=softcap)
    close(got, want, dtype)


def test_an_exported_graph_keeps_each_kernel_one_node():
    class Step(torch.nn.Module):
        def forward(self, x, w):
            return elementwise.silu_and_mul(elementwise.rms_norm(x, w, 1e-6))

    x, w = torch.randn(5, 32), torch.randn(32)
    program = torch.export.export(Step(), (x, w), dynamic_shapes=({0: torch.export.Dim("T", min=1, max=64)}, None))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops == [torch.ops.kiln_gpu.rms_norm.default, torch.ops.kiln_gpu.silu_and_mul.default]
    torch.testing.assert_close(program.module()(x, w), reference.silu_and_mul(reference.rms_norm(x, w, 1e-6)))
