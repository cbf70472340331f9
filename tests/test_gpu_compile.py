"""Every Triton kernel as the ops launch it, compiled for an H100 (sm_90) by Triton's own compiler
and ptxas: what the interpreter cannot check (a global read inside a kernel, a type the GPU's dot
does not take, a block too large for the registers). No GPU needed, nothing runs.

The ops run once on small bfloat16 and float32 inputs in the interpreter with each launch recorded
(kernel, argument types, constexprs); a fresh process without the interpreter compiles each one."""
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import require

require("triton", "OpenAI Triton is not installed (pip install 'kiln-llm[gpu]')", module_level=True)

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from test_gpu_kernels import _step  # noqa: E402

TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8", torch.uint8: "u8",
         torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv", torch.bool: "i1"}

COMPILE = """
import json, sys, importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
failed = []
for launch in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    try:
        triton.compile(ASTSource(fn=kernel, signature=launch["signature"], constexprs=launch["constexprs"]),
                       target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:
        failed.append(f"{launch['kernel']} {launch['constexprs']}: {type(e).__name__}: {str(e)[-600:]}")
print(json.dumps(failed))
"""


def _type(value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    return "fp32"


@pytest.fixture(scope="module")
def launches(monkeypatch_module):
    recorded = {}
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        fn = self.fn
        params = inspect.signature(fn).parameters
        bound = dict(zip(params, args)) | {k: v for k, v in kwargs.items() if k in params}
        options = {k: v for k, v in kwargs.items() if k not in params}  # num_warps, num_stages
        constexprs = {n: v for n, v in bound.items() if params[n].annotation is tl.constexpr}
        signature = {n: "constexpr" if n in constexprs else _type(v) for n, v in bound.items()}
        launch = {"module": fn.__module__, "kernel": fn.__name__, "signature": signature, "constexprs": constexprs,
                  "options": {"num_warps": 4} | options}
        recorded.setdefault(json.dumps(launch, sort_keys=True), launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch_module.setattr(InterpretedFunction, "run", record)
    _run_every_op()
    return list(recorded.values())


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _run_every_op():
    from kiln.plugins.gpu import attention, elementwise, gemm, lora, moe

    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(5, 64, dtype=dtype)
        elementwise.fused_add_rms_norm(x, x, x[0], 1e-6)
        elementwise.rms_norm(x.view(5, 2, 32), x[0, :32], 1e-6)
        elementwise.rotary_embedding(x.view(5, 2, 32), x.view(5, 2, 32), torch.randn(5, 12), torch.randn(5, 12))
        elementwise.silu_and_mul(x)
        elementwise.gelu_tanh_and_mul(x)
        for kv_dtype, window, softcap in ((dtype, 8, 30.0), (torch.float8_e4m3fn, 0, 0.0), (torch.int8, 0, 0.0)):
            q, kv, pages, scale = _step(dtype, kv_dtype, 8, 2, 64, 16, [(40, 9), (300, 1)], window)
            attention.kv_cache_write(kv, 1, q[:, :2], q[:, :2], torch.arange(q.shape[0]), scale)
            attention.paged_attention(q, kv, 1, *pages, 0.125, scale, window=window, softcap=softcap)
        w8, scale8 = torch.randint(-128, 127, (96, 64), dtype=torch.int8), torch.rand(96)
        for m in (1, 40, 300):  # each token count's tile
            gemm.w8a16(torch.randn(m, 64, dtype=dtype), w8, scale8, None)
            q4 = torch.randint(-8, 7, (96, 64), dtype=torch.int8)
            packed, scales = gemm.pack_int4(((q4[0::2] & 0xF) | (q4[1::2] << 4)).to(torch.int8), torch.rand(96, 2), 32)
            gemm.w4a16(torch.randn(m, 64, dtype=dtype), packed, scales, 32, torch.randn(96, dtype=dtype),
                       torch.rand(64, dtype=dtype) + 0.5)
        ids = torch.randint(0, 4, (7, 2))
        moe.fused_moe(torch.randn(7, 64, dtype=dtype), ids, torch.rand(7, 2), torch.randn(4, 64, 64, dtype=dtype),
                      torch.randn(4, 64, 32, dtype=dtype))
        pools = {"attn_q": torch.randn(2, 3, 8, 64 + 64, dtype=dtype)}
        adapters = lora.TritonAdapters(torch.tensor([0, -1, 2, 1, 0]), torch.tensor([8, 4, 0]), pools)
        adapters(1, torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype), ("attn_q", 0))


def test_every_kernel_compiles_for_sm90(launches):
    kernels = {launch["kernel"] for launch in launches}
    assert {"_rms_norm_kernel", "_rotary_kernel", "_gated_kernel", "_kv_write_kernel", "_context_kernel",
            "_decode_kernel", "_merge_kernel", "_w8a16_kernel", "_w4a16_kernel", "_expert_gemm", "_shrink_kernel",
            "_expand_kernel"} <= kernels, kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(launches), capture_output=True,
                            text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert not failed, "\n".join(failed)
