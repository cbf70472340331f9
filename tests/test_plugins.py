"""Plugin ops (kiln/plugins): the fast CPU path and the registered `torch.ops.kiln.*` custom op are
held to the plain-torch reference (the spec), in float32 (tight) and bfloat16 (against the float32
reference on the same bf16-rounded inputs). Paged attention is also checked against dense causal
attention (SDPA on contiguous K/V), an oracle independent of the paged layout. Small and CPU only.
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kiln.plugins import cpu, ops, reference  # noqa: F401  (ops registers torch.ops.kiln.*)

K = torch.ops.kiln
F32_TOL = dict(atol=1e-5, rtol=1e-5)
# bf16 has 8 significant bits (relative spacing 2^-7 ~ 7.8e-3): a result rounded to bf16 once or
# twice (intermediates) is within ~2 spacings of the float32 result; the measured worst cases are ~1.
BF16_TOL = dict(atol=1e-2, rtol=1.6e-2)


def _paths(name):
    """(label, fn) for the CPU path and the registered custom op of plugin `name`."""
    return [("cpu", getattr(cpu, name)), ("op", getattr(K, name))]


def _close(actual, expected, dtype, msg=""):
    assert actual.dtype == dtype, msg
    tol = F32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=lambda m: f"{msg}: {m}")


def _round(*tensors, dtype):
    """Inputs rounded to `dtype` (what the paths under test get) and their float32 copies (the reference's)."""
    low = [t.to(dtype) for t in tensors]
    return low, [t.float() for t in low]


DTYPES = [torch.float32, torch.bfloat16]


# --------------------------------------------------------------------------- elementwise plugins


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(dtype):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(7, 3, 64, generator=g) * 3, torch.rand(64, generator=g) + 0.5
    (xl, wl), (xf, wf) = _round(x, w, dtype=dtype)
    expected = reference.rms_norm(xf, wf, 1e-6)
    # the reference itself against torch's own RMSNorm in float64, an independent oracle
    torch.testing.assert_close(expected.double(), F.rms_norm(xf.double(), (64,), wf.double(), 1e-6),
                               **F32_TOL)
    _close(reference.rms_norm(xl, wl, 1e-6), expected, dtype, "reference")
    for label, fn in _paths("rms_norm"):
        _close(fn(xl, wl, 1e-6), expected, dtype, label)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(dtype):
    g = torch.Generator().manual_seed(1)
    x, res, w = torch.randn(9, 48, generator=g), torch.randn(9, 48, generator=g) * 4, torch.rand(48, generator=g) + 0.5
    (xl, rl, wl), (xf, rf, wf) = _round(x, res, w, dtype=dtype)
    ref_out, ref_res = reference.fused_add_rms_norm(xf, rf, wf, 1e-5)
    torch.testing.assert_close(ref_out.double(), F.rms_norm((xf + rf).double(), (48,), wf.double(), 1e-5),
                               **F32_TOL)
    for label, fn in _paths("fused_add_rms_norm"):
        x_before, r_before = xl.clone(), rl.clone()
        out, new_res = fn(xl, rl, wl, 1e-5)
        _close(out, ref_out, dtype, label)
        _close(new_res, ref_res, dtype, label + " residual")
        # The residual sum must be the one the reference rounds to dtype, and the inputs stay untouched.
        torch.testing.assert_close(new_res, (xf + rf).to(dtype), atol=0, rtol=0)
        assert torch.equal(xl, x_before) and torch.equal(rl, r_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [32, 16], ids=["full", "partial"])
def test_rotary_embedding(dtype, rot_dim):
    g = torch.Generator().manual_seed(2)
    T, H, KH, D = 11, 4, 2, 32
    q, k = torch.randn(T, H, D, generator=g), torch.randn(T, KH, D, generator=g)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim)
    angles = torch.randint(0, 4096, (T,), generator=g).float()[:, None] * inv_freq  # positions
    cos, sin = angles.cos(), angles.sin()  # float32, as kiln.models.rope produces them
    (ql, kl), (qf, kf) = _round(q, k, dtype=dtype)
    ref_q, ref_k = reference.rotary_embedding(qf, kf, cos, sin)
    if rot_dim < D:  # the dims past the rotary ones pass through
        assert torch.equal(ref_q[..., rot_dim:], qf[..., rot_dim:])
    # the reference against an independent oracle: pairs (i, i + rot_dim/2) as complex numbers
    # turned by e^{i * angle}, in float64
    half = rot_dim // 2
    z = torch.complex(qf[..., :half].double(), qf[..., half:rot_dim].double()) * torch.polar(
        torch.ones_like(angles.double()), angles.double())[:, None, :]
    torch.testing.assert_close(ref_q[..., :rot_dim].double(), torch.cat([z.real, z.imag], -1), **F32_TOL)
    for label, fn in _paths("rotary_embedding"):
        out_q, out_k = fn(ql, kl, cos, sin)
        _close(out_q, ref_q, dtype, label + " q")
        _close(out_k, ref_k, dtype, label + " k")


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 2 * 40, generator=g) * 3
    (xl,), (xf,) = _round(x, dtype=dtype)
    expected = reference.silu_and_mul(xf)
    assert expected.shape == (5, 3, 40)
    for label, fn in _paths("silu_and_mul"):
        _close(fn(xl), expected, dtype, label)


# --------------------------------------------------------------------------- KV cache write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_cache_write(dtype, block_size):
    g = torch.Generator().manual_seed(4)
    L, NB, KH, D, T = 2, 6, 2, 8, 13
    cache0 = torch.randn(L, 2, NB, block_size, KH, D, generator=g).to(dtype)
    k, v = torch.randn(T, KH, D, generator=g).to(dtype), torch.randn(T, KH, D, generator=g).to(dtype)
    slots = torch.randperm(NB * block_size, generator=g)[:T]  # distinct, scattered over blocks
    layer = 1

    expected = cache0.clone()
    reference.kv_cache_write(expected, layer, k, v, slots)
    written = torch.zeros(cache0.shape[:4], dtype=torch.bool)
    written[layer, :, slots // block_size, slots % block_size] = True
    assert torch.equal(expected[~written], cache0[~written])  # the reference itself: only those slots
    for t, s in enumerate(slots.tolist()):
        assert torch.equal(expected[layer, 0, s // block_size, s % block_size], k[t])
        assert torch.equal(expected[layer, 1, s // block_size, s % block_size], v[t])

    for label, fn in _paths("kv_cache_write"):
        cache = cache0.clone()
        ptr = cache.data_ptr()
        assert fn(cache, layer, k, v, slots) is None, label
        assert cache.data_ptr() == ptr, label  # in place
        assert torch.equal(cache, expected), label  # exactly those slots; everything else untouched


# --------------------------------------------------------------------------- paged attention


def _make_step(requests, *, layers, kv_heads, heads, head_dim, block_size, seed,
               extra_q_pad=0, extra_block_pad=0):
    """A paged-attention step built the way kiln/runtime/core/step_plan.py builds it.

    requests: (kind, context_len, q_len) with kind "ctx" (a prefill chunk of q_len tokens after
    context_len - q_len cached ones) or "gen" (q_len 1). Tokens lie in the flat batch in request
    order; each sequence owns shuffled, non-contiguous blocks. Returns the op's inputs and, per
    request, its contiguous float32 K/V [context_len, KH, D] and flat token indices.
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [-(-n // block_size) for _, n, _ in requests]
    num_blocks = sum(need) + 7  # spare blocks hold garbage that must never be read
    cache = torch.randn(layers, 2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    free = list(range(num_blocks))
    rng.shuffle(free)
    T = sum(q for _, _, q in requests)
    q = torch.randn(T, heads, head_dim, generator=g)
    layer = layers - 1

    seqs, ctx, gen = [], [], []
    first = 0
    for (kind, length, q_len), nb in zip(requests, need):
        assert 1 <= q_len <= length and (kind == "ctx" or q_len == 1)
        table = [free.pop() for _ in range(nb)]
        k = torch.randn(length, kv_heads, head_dim, generator=g)
        v = torch.randn(length, kv_heads, head_dim, generator=g)
        pos = torch.arange(length)
        blocks = torch.tensor(table)[pos // block_size]
        cache[layer, 0, blocks, pos % block_size] = k
        cache[layer, 1, blocks, pos % block_size] = v
        tokens = list(range(first, first + q_len))
        first += q_len
        seqs.append(dict(k=k, v=v, tokens=tokens, length=length))
        (ctx if kind == "ctx" else gen).append((tokens, table, length))

    def pad(rows, value, extra):
        width = max([len(r) for r in rows] + [1]) + extra
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.int64).view(len(rows), width)

    i32 = dict(dtype=torch.int32)
    inputs = dict(
        q=q, kv_cache=cache, layer=layer,
        ctx_token_index=pad([c[0] for c in ctx], -1, extra_q_pad),
        ctx_block_tables=pad([c[1] for c in ctx], 0, extra_block_pad).to(torch.int32),
        ctx_context_lens=torch.tensor([c[2] for c in ctx], **i32),
        gen_token_index=torch.tensor([c[0][0] for c in gen], dtype=torch.int64),
        gen_block_tables=pad([c[1] for c in gen], 0, extra_block_pad).to(torch.int32),
        gen_context_lens=torch.tensor([c[2] for c in gen], **i32),
        scale=head_dim ** -0.5,
    )
    return inputs, seqs


def _dense_attention(q, seqs, scale):
    """Causal attention per sequence with SDPA on its contiguous K/V. The new tokens are the last q_len
    of the sequence, so the causal mask is aligned to the bottom right (torch's causal_lower_right)."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for s in seqs:
        n, length = len(s["tokens"]), s["length"]
        o = F.scaled_dot_product_attention(q[s["tokens"]].float().transpose(0, 1), s["k"].transpose(0, 1),
                                           s["v"].transpose(0, 1), attn_mask=causal_lower_right(n, length),
                                           scale=scale, enable_gqa=True)
        out[s["tokens"]] = o.transpose(0, 1)
    return out


def _args(inputs):
    return tuple(inputs[k] for k in ("q", "kv_cache", "layer", "ctx_token_index", "ctx_block_tables",
                                     "ctx_context_lens", "gen_token_index", "gen_block_tables",
                                     "gen_context_lens", "scale"))


# Context requests include chunks that start past cached tokens (q_len < context_len), a one-token
# context, full prefills and a chunk at the end of a ~1000-token sequence; generation requests
# cover the same lengths. Ctx and gen tokens are interleaved in the flat batch, as the scheduler mixes them.
MIXED = [("ctx", 17, 17), ("gen", 1000, 1), ("ctx", 128, 40), ("gen", 1, 1), ("ctx", 1, 1),
         ("gen", 17, 1), ("ctx", 1000, 24), ("gen", 128, 1), ("ctx", 33, 5), ("gen", 129, 1)]
STEPS = {
    "mixed": MIXED,
    "ctx_only": [r for r in MIXED if r[0] == "ctx"] + [("ctx", 128, 128)],  # Sg = 0
    "gen_only": [r for r in MIXED if r[0] == "gen"] + [("gen", 31, 1)],  # Sc = 0
}
HEADS = {"mha": (2, 2), "gqa3": (2, 6), "gqa8": (2, 16), "mqa": (1, 4)}  # (kv_heads, heads)


@pytest.mark.parametrize("heads", HEADS, ids=list(HEADS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("step", STEPS, ids=list(STEPS))
def test_paged_attention(step, block_size, heads):
    kv_heads, num_heads = HEADS[heads]
    seed = zlib.crc32(f"{step}/{block_size}/{heads}".encode())
    inputs, seqs = _make_step(STEPS[step], layers=2, kv_heads=kv_heads, heads=num_heads, head_dim=16,
                              block_size=block_size, seed=seed, extra_q_pad=3, extra_block_pad=2)
    if step == "ctx_only":
        assert inputs["gen_token_index"].shape == (0,) and inputs["gen_block_tables"].shape[0] == 0
    if step == "gen_only":
        assert inputs["ctx_token_index"].shape[0] == 0 and inputs["ctx_context_lens"].shape == (0,)
    args = _args(inputs)
    expected = reference.paged_attention(*args)
    assert expected.dtype == torch.float32
    # The spec against the independent dense oracle.
    torch.testing.assert_close(expected, _dense_attention(inputs["q"], seqs, inputs["scale"]), **F32_TOL)

    cache_before = inputs["kv_cache"].clone()
    for label, fn in _paths("paged_attention"):
        _close(fn(*args), expected, torch.float32, f"{label} float32")
    assert torch.equal(inputs["kv_cache"], cache_before)  # attention only reads the cache

    # bfloat16 q and cache, against the float32 reference on the same rounded values.
    q16, cache16 = inputs["q"].to(torch.bfloat16), inputs["kv_cache"].to(torch.bfloat16)
    args16 = (q16, cache16, *args[2:])
    expected16 = reference.paged_attention(q16.float(), cache16.float(), *args[2:])
    for label, fn in _paths("paged_attention"):
        _close(fn(*args16), expected16, torch.bfloat16, f"{label} bfloat16")


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    g = torch.Generator().manual_seed(6)
    x, w = torch.randn(3, 8, generator=g), torch.rand(8, generator=g) + 0.5
    q, k = torch.randn(3, 4, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    cos, sin = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    cache = torch.randn(2, 2, 4, 4, 2, 8, generator=g)
    slots = torch.tensor([5, 0, 13])
    step, _ = _make_step([("ctx", 9, 3), ("gen", 6, 1), ("ctx", 2, 2)], layers=2, kv_heads=2, heads=4,
                         head_dim=8, block_size=4, seed=7)
    return {
        "rms_norm": (K.rms_norm, (x, w, 1e-6)),
        "fused_add_rms_norm": (K.fused_add_rms_norm, (x, torch.randn(3, 8, generator=g), w, 1e-6)),
        "rotary_embedding": (K.rotary_embedding, (q, k, cos, sin)),
        "silu_and_mul": (K.silu_and_mul, (torch.randn(3, 16, generator=g),)),
        "kv_cache_write": (K.kv_cache_write, (cache, 1, k, k.clone(), slots)),
        "paged_attention": (K.paged_attention, _args(step)),
    }


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                                  "kv_cache_write", "paged_attention"])
def test_opcheck(name):
    op, args = _opcheck_cases()[name]
    # All of opcheck's default checks (test_schema, test_autograd_registration, test_faketensor,
    # test_aot_dispatch_dynamic) apply: no input requires grad, so the autograd checks pass without
    # an autograd formula (the plugins are inference-only).
    torch.library.opcheck(op, args)
