"""The C++ elementwise plugins (kiln/plugins/csrc/elementwise.cpp: rms_norm, fused_add_rms_norm,
rotary_embedding, silu_and_mul) against the reference (kiln/plugins/reference.py): float32 tightly,
bfloat16 and float16 to within one rounding of the output; strided views of the fused QKV output read
in place; the same bits for every thread count and schedule; bad inputs refused by name; and the ops
in an engine (tests/test_e2e.py and tests/test_gemm.py run whole models on them)."""
import pytest
import torch

from kiln.plugins import cpp, reference

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
THREADS = [1, 2, 3, 5]


@pytest.fixture(scope="module")
def ops():
    cpp.load()
    return torch.ops.kiln_cpp


def _close(got, want, dtype):
    assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # the reference rounds once too; the float sums differ in order only, so ties may round apart
        spacing = torch.finfo(dtype).eps * want.float().abs().clamp(min=1e-3)
        assert ((got.float() - want.float()).abs() <= spacing + 1e-6).all()


def _qkv(T, H, KH, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (H + 2 * KH) * D, generator=g) * 2).to(dtype)
    q, k, v = qkv.split([H * D, KH * D, KH * D], dim=-1)
    return q.view(T, H, D), k.view(T, KH, D), v.view(T, KH, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 6, 130])
@pytest.mark.parametrize("D", [64, 579])  # a multiple of every vector width, and one that is none
def test_norms_match_reference(ops, dtype, T, D):
    g = torch.Generator().manual_seed(T * D)
    x, res = (torch.randn(T, D, generator=g) * 3).to(dtype), (torch.randn(T, D, generator=g) * 5).to(dtype)
    w = (torch.rand(D, generator=g) + 0.5).to(dtype)
    _close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), dtype)
    before = x.clone(), res.clone()
    out, total = ops.fused_add_rms_norm(x, res, w, 1e-5)
    want_out, want_total = reference.fused_add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(total, want_total)  # the sum rounded once to dtype, as the reference does
    _close(out, want_out, dtype)  # and the norm taken of that rounded sum
    assert torch.equal(x, before[0]) and torch.equal(res, before[1])
    # a float32 weight with low-precision activations (HF keeps norms in float32 in some configs)
    _close(ops.rms_norm(x, w.float(), 1e-5), reference.rms_norm(x, w.float(), 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rot_dim", [64, 32], ids=["full", "partial"])
def test_rope_and_qk_norm_on_strided_qkv(ops, dtype, rot_dim):
    """q and k are views into the fused QKV output ([T, H, D] with a row stride of the whole QKV
    width), as the model hands them over: read in place, written contiguous."""
    T, H, KH, D = 9, 6, 2, 64
    q, k, _ = _qkv(T, H, KH, D, dtype, seed=rot_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    angles = torch.arange(T).float()[:, None] * 1e4 ** -(torch.arange(0, rot_dim, 2).float() / rot_dim)
    cos, sin = angles.cos(), angles.sin()
    got_q, got_k = ops.rotary_embedding(q, k, cos, sin)
    want_q, want_k = reference.rotary_embedding(q, k, cos, sin)
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    if rot_dim < D:  # the dims past the rotary ones pass through unchanged
        assert torch.equal(got_q[..., rot_dim:], q[..., rot_dim:])
    w = (torch.rand(D) + 0.5).to(dtype)
    _close(ops.rms_norm(q, w, 1e-6), reference.rms_norm(q, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (33, 2 * 100), (4, 3, 2 * 24)])
def test_silu_and_mul_matches_reference(ops, dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    x = (torch.randn(*shape, generator=g) * 6).to(dtype)  # far into both tails of the sigmoid
    _close(ops.silu_and_mul(x), reference.silu_and_mul(x), dtype)
    # a strided view: the gate/up halves of a wider row
    wide = (torch.randn(shape[0], shape[-1] + 8, generator=g)).to(dtype)[:, : shape[-1]]
    _close(ops.silu_and_mul(wide), reference.silu_and_mul(wide), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_far_tails(ops, dtype):
    """Gates where e^-g overflows float: the kernels cap it at e^80 (so that their reciprocal estimate
    is not of inf), which leaves g * e^-80, below 1e-25, where silu is ~0; not NaN."""
    gate = torch.tensor([-3e4, -1e3, -120.0, -89.0, -80.0, -20.0, 0.0, 20.0, 89.0, 1e3, 3e4] * 3)
    x = torch.cat([gate, torch.linspace(-2, 2, len(gate))]).to(dtype)[None]
    got, want = ops.silu_and_mul(x), reference.silu_and_mul(x)
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-25)


@pytest.fixture
def pool_settings():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    torch.ops.kiln_cpp.set_parallel_options("dynamic", 50)


def test_same_bits_for_every_split(ops, pool_settings):
    """Rows are independent: however the pool cuts them into chunks and whoever claims them, every
    output element is computed by the same code, so the results are equal to the bit."""
    T, D = 300, 576
    x, res = torch.randn(T, D).bfloat16(), torch.randn(T, D).bfloat16()
    w = torch.rand(D).bfloat16()
    q, k, _ = _qkv(T, 9, 3, 64, torch.bfloat16, seed=1)
    cos, sin = torch.randn(T, 32), torch.randn(T, 32)
    gate_up = torch.randn(T, 2 * 1536).bfloat16()

    def run():
        return (ops.rms_norm(x, w, 1e-5), *ops.fused_add_rms_norm(x, res, w, 1e-5),
                *ops.rotary_embedding(q, k, cos, sin), ops.silu_and_mul(gate_up))

    torch.set_num_threads(1)
    one = run()
    for threads in THREADS:
        torch.set_num_threads(threads)
        for schedule in ("static", "dynamic"):
            torch.ops.kiln_cpp.set_parallel_options(schedule)
            for got, want in zip(run(), one):
                assert torch.equal(got, want), (threads, schedule)


@pytest.mark.parametrize("name", ["rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul"])
def test_opcheck(ops, name):
    q, k, _ = _qkv(3, 4, 2, 16, torch.float32, seed=0)
    args = {"rms_norm": (torch.randn(3, 2, 16), torch.randn(16), 1e-6),
            "fused_add_rms_norm": (torch.randn(3, 16), torch.randn(3, 16), torch.randn(16), 1e-6),
            "rotary_embedding": (q, k, torch.randn(3, 8), torch.randn(3, 8)),
            "silu_and_mul": (torch.randn(3, 32),)}[name]
    torch.library.opcheck(getattr(ops, name), args)


@pytest.mark.parametrize("call, message", [
    (lambda o: o.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6), "weight must be a contiguous 1-D CPU tensor of x's last dim (8)"),
    (lambda o: o.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-6), "x must be float32, bfloat16 or float16"),
    (lambda o: o.rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(8).half(), 1e-6), "weight must be x's dtype"),
    (lambda o: o.rms_norm(torch.randn(8, 2).t(), torch.randn(8), 1e-6), "x must have a contiguous last dim"),
    (lambda o: o.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8), 1e-6),
     "x and residual must have one shape and dtype"),
    (lambda o: o.rotary_embedding(torch.randn(2, 4, 8), torch.randn(3, 2, 8), torch.randn(2, 4), torch.randn(2, 4)),
     "q and k must be [T, H, D] tensors of one T, D and dtype"),
    (lambda o: o.rotary_embedding(torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 5), torch.randn(2, 5)),
     "R <= head size 8"),
    (lambda o: o.silu_and_mul(torch.randn(2, 7)), "x must be a [..., 2I] tensor"),
])
def test_bad_inputs_raise(ops, call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        call(ops)
