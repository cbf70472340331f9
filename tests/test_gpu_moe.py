"""The Triton fused MoE (kiln_gpu::fused_moe, run on CPU tensors in Triton's interpreter) against a
per-expert loop, and TritonMoeMLP against HF's sparse MoE blocks: Mixtral's (top 2 renormalized),
Qwen2-MoE's (top 4 as they are, a gated shared expert), W8A16 experts, experts split across ranks."""
import pytest
import torch

from conftest import require
from kiln.config import ConfigError, Mapping, MoeConfig, PretrainedConfig, QuantConfig

require("triton", "the Triton kernels need triton (pip install 'kiln-llm[gpu]')", module_level=True)

from kiln.models.gpu_moe import TritonMoeMLP  # noqa: E402
from kiln.plugins import cpu  # noqa: E402
from kiln.plugins.gpu.moe import align, fused_moe  # noqa: E402

P = "transformer.layers.0."


def reference_moe(x, ids, weights, fc, proj, expert_start):
    """HF's loop in float32: each held expert (fc rows [gate; up]) on its tokens, weighted, summed."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    inter = fc.shape[1] // 2
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].float().tolist()):
            if 0 <= e - expert_start < fc.shape[0]:
                h = x[t].float() @ fc[e - expert_start].float().T
                out[t] += w * ((torch.nn.functional.silu(h[:inter]) * h[inter:]) @ proj[e - expert_start].float().T)
    return out


def test_align_sorts_pairs_into_blocks_per_expert():
    sorted_ids, blocks = align(torch.tensor([2, 0, 2, 5, -1, 2]), 3, 4)
    n = 6  # padding
    assert sorted_ids.tolist() == [1, n, n, n, 0, 2, 5, n] + [n] * 8
    assert blocks.tolist() == [0, 2, -1, -1]


def _quantize(w):
    scale = w.abs().amax(-1) / 127
    return (w / scale[..., None]).round().to(torch.int8), scale


@pytest.mark.parametrize("fmt,T,E,k,renormalize", [
    ("float32", 1, 4, 1, False), ("float32", 5, 8, 2, True), ("float32", 33, 8, 2, False),
    ("bfloat16", 33, 4, 2, True), ("bfloat16", 5, 8, 1, False), ("float16", 5, 4, 2, True),
    ("int8", 33, 8, 2, True), ("int8-bf16", 5, 4, 2, False)])
def test_fused_moe_matches_the_per_expert_loop(fmt, T, E, k, renormalize):
    """Experts 1 .. E held here of E + 2: pairs routed to experts 0 and E + 1 are another rank's."""
    g = torch.Generator().manual_seed(T * 10 + E)
    H, inter, start = 64, 40, 1  # inter not a multiple of the tiles: masked edges
    dtype = {"bfloat16": torch.bfloat16, "int8-bf16": torch.bfloat16, "float16": torch.float16}.get(fmt, torch.float32)
    fc = torch.randn(E, 2 * inter, H, generator=g) * 0.1
    proj = torch.randn(E, H, inter, generator=g) * 0.1
    x = torch.randn(T, H, generator=g).to(dtype)
    probs = torch.softmax(torch.randn(T, E + 2, generator=g), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights.to(dtype)
    if fmt.startswith("int8"):
        (qfc, sfc), (qproj, sproj) = _quantize(fc), _quantize(proj)
        got = fused_moe(x, ids, weights, qfc, qproj, sfc, sproj, start)
        fc, proj = qfc.float() * sfc[..., None], qproj.float() * sproj[..., None]
    else:
        fc, proj = fc.to(dtype), proj.to(dtype)
        got = fused_moe(x, ids, weights, fc, proj, None, None, start)
    want = reference_moe(x, ids, weights, fc, proj, start)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    assert want.abs().max() > 0.05


def test_fused_moe_rejects_bad_input():
    x, ids, w = torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.int64), torch.rand(3, 2)
    fc, proj = torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    with pytest.raises(ConfigError, match=r"w_fc must be \[experts, 2 \* inter, hidden\]"):
        fused_moe(x, ids, w, fc, proj[:, :, :8])
    with pytest.raises(ConfigError, match=r"topk_ids and topk_weights must both be \[T, top_k\]"):
        fused_moe(x, ids[:2], w, fc, proj)
    with pytest.raises(ConfigError, match="int8 ones .W8A16. with fc_scale"):
        fused_moe(x, ids, w, fc.to(torch.int8), proj.to(torch.int8))


def _hf_block(kind, dtype, **extra):
    import transformers

    if kind == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8,
                                         num_experts_per_tok=2, **extra)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock as Block
        cfg = transformers.Qwen2MoeConfig(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                          num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, **extra)
    torch.manual_seed(0)
    block = Block(cfg).to(dtype).eval()
    if not isinstance(block.experts, torch.nn.ModuleList):
        pytest.skip(f"transformers {transformers.__version__} fuses the experts; this test reads 4.x's modules")
    return block


def _parts(mlp):
    return (mlp.w1, mlp.w3, mlp.w2) if hasattr(mlp, "w1") else (mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def _kiln_weights(block, experts: range) -> dict:
    """The checkpoint's tensors of one rank (kiln/convert/shard.py's layout: fc rows [up; gate])."""
    parts = [_parts(block.experts[e]) for e in experts]
    w = {P + "mlp.router.weight": block.gate.weight.data,
         P + "mlp.fc.weight": torch.stack([torch.cat([up.weight, gate.weight]) for gate, up, _ in parts]).data,
         P + "mlp.proj.weight": torch.stack([down.weight for _, _, down in parts]).data}
    if hasattr(block, "shared_expert"):
        gate, up, down = _parts(block.shared_expert)
        for name, linear in (("fc", gate), ("gate", up), ("proj", down)):  # kiln/layout.py's SHARED
            w[P + f"mlp.shared_expert.{name}.weight"] = linear.weight.data
        w[P + "mlp.shared_expert_gate.weight"] = block.shared_expert_gate.weight.data
    return w


def _config(kind, dtype, ep=1, quant=None):
    arch, moe = (("MixtralForCausalLM", MoeConfig(8, 2, 1)) if kind == "mixtral" else
                 ("Qwen2MoeForCausalLM", MoeConfig(8, 4, 0, shared_expert_intermediate_size=48)))
    return PretrainedConfig(arch, str(dtype).removeprefix("torch."), 64, 64, 1, 4, 2, 16, 96, 128, moe=moe,
                            moe_intermediate_size=32, mapping=Mapping(world_size=ep, tp_size=ep, moe_ep_size=ep),
                            quantization=QuantConfig(quant_algo=quant))


def _hf(block, x):
    out = block(x[None])
    return (out[0] if isinstance(out, tuple) else out)[0]


@pytest.mark.parametrize("kind,dtype", [("mixtral", torch.float32), ("mixtral", torch.bfloat16),
                                        ("qwen2_moe", torch.float32)])
def test_triton_moe_mlp_matches_hf(kind, dtype):
    block = _hf_block(kind, dtype)
    mlp = TritonMoeMLP(_config(kind, dtype), _kiln_weights(block, range(8)), P, 0, cpu.silu_and_mul)
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.no_grad():
        got, want = mlp(x), _hf(block, x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_triton_moe_mlp_expert_parallel_ranks_sum_to_hf():
    """Two expert-parallel ranks, experts 0-3 and 4-7: each returns its partial sum."""
    block = _hf_block("mixtral", torch.float32)
    config = _config("mixtral", torch.float32, ep=2)
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        parts = [TritonMoeMLP(config, _kiln_weights(block, range(4 * r, 4 * r + 4)), P, r, cpu.silu_and_mul)(x)
                 for r in range(2)]
        torch.testing.assert_close(parts[0] + parts[1], _hf(block, x), atol=1e-5, rtol=1e-5)
    assert parts[0].abs().max() > 0 and parts[1].abs().max() > 0


def test_triton_moe_mlp_w8a16_experts():
    """int8 experts, their scales reordered gate first with the rows: HF's block on the same grid."""
    block = _hf_block("mixtral", torch.float32)
    for mlp in block.experts:
        for linear in _parts(mlp):
            q, s = _quantize(linear.weight.data)
            linear.weight.data = q.float() * s[:, None]
    weights = _kiln_weights(block, range(8))
    for name in ("mlp.fc", "mlp.proj"):
        q, s = _quantize(weights[P + name + ".weight"])
        weights.update({P + name + ".weight": q, P + name + ".weights_scaling_factor": s})
    mlp = TritonMoeMLP(_config("mixtral", torch.float32, quant="W8A16"), weights, P, 0, cpu.silu_and_mul)
    assert mlp.fc.dtype == torch.int8
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), _hf(block, x), atol=1e-5, rtol=1e-5)


def test_triton_moe_mlp_names_the_supported_expert_formats():
    config = _config("mixtral", torch.float32, quant="W4A16")
    weights = {P + "mlp.router.weight": torch.zeros(8, 64),
               P + "mlp.fc.weight": torch.zeros(8, 32, 64, dtype=torch.int8)}
    with pytest.raises(ConfigError, match="quant_algo W4A16 .* expected unquantized or W8A16"):
        TritonMoeMLP(config, weights, P, 0, cpu.silu_and_mul)


def test_an_exported_mlp_keeps_the_experts_one_node():
    block = _hf_block("mixtral", torch.float32)
    mlp = TritonMoeMLP(_config("mixtral", torch.float32), _kiln_weights(block, range(8)), P, 0, cpu.silu_and_mul)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(4))
    program = torch.export.export(mlp, (x[:3],), dynamic_shapes=({0: torch.export.Dim("T", min=1, max=64)},))
    ops = [n.target for n in program.graph.nodes if n.op == "call_function"]
    assert ops.count(torch.ops.kiln_gpu.fused_moe.default) == 1
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), _hf(block, x), atol=1e-5, rtol=1e-5)
