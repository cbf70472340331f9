"""The kiln_cpp kernels' thread pool (csrc/thread_pool.h): chunks claimed dynamically give the same
results as a static split for every thread count (GEMM, paged attention, sampler); the pool follows
torch's thread count; it survives fork; an engine step runs the graph's own loops on one thread; and
decode GEMMs learn the next weight for the pool's prefetch."""
import multiprocessing

import pytest
import torch

from kiln.plugins import cpp, gemm, reference
from test_gemm import _weights
from test_plugins import _args, _make_step

THREADS = [1, 2, 3, 4, 7]


@pytest.fixture
def pool_settings():
    cpp.load()
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    torch.ops.kiln_cpp.set_num_threads(0)
    torch.ops.kiln_cpp.set_parallel_options("dynamic", 50, 2048)


def _each_split(run):
    """run() under every thread count, static then dynamic: {(threads, schedule): result}."""
    out = {}
    for threads in THREADS:
        torch.set_num_threads(threads)
        for schedule in ("static", "dynamic"):
            torch.ops.kiln_cpp.set_parallel_options(schedule)
            out[threads, schedule] = run()
    return out


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
@pytest.mark.parametrize("m", [1, 5, 64])
def test_gemm_same_for_every_split(pool_settings, fmt, m):
    packed, scale, g, _ = _weights(fmt, 300, 128)
    x = torch.randn(m, 128).bfloat16()
    results = _each_split(lambda: gemm.gemm(x, packed, scale, None, 300, g, True))
    one = results[1, "static"]
    for key, out in results.items():
        assert torch.equal(out, one), key  # each column is one thread's, summed in one order


def test_attention_same_for_every_split(pool_settings):
    inputs, _ = _make_step([("gen", 700, 1), ("ctx", 90, 40), ("gen", 33, 1), ("gen", 1, 1)], layers=1,
                           kv_heads=2, heads=6, head_dim=32, block_size=16, seed=5)
    args = _args(inputs)
    expected = reference.paged_attention(*args)
    results = _each_split(lambda: cpp.paged_attention_op()(*args))
    for threads in THREADS:
        # The work items (flash-decoding partitions) follow the thread count, not the schedule.
        assert torch.equal(results[threads, "dynamic"], results[threads, "static"]), threads
        torch.testing.assert_close(results[threads, "dynamic"], expected, rtol=1e-4, atol=1e-5)


def test_sampler_same_for_every_split(pool_settings):
    from kiln.runtime.core.sample.rows import SampleRow
    from kiln.runtime.core.sample.sampler import Sampler
    from kiln.runtime.sampling_params import SamplingParams
    from test_sampler_cpp import history, logits_for, make_generator

    rows = [SampleRow(SamplingParams(temperature=0.9, top_p=0.9, top_k=40 * (i % 3), seed=i, logprobs=2),
                      *history(i, 4096), make_generator(i), (2,)) for i in range(40)]
    x = logits_for(4096, len(rows), 11)
    sampler = Sampler("cpp")
    results = _each_split(lambda: sampler(x, rows))
    one = results[1, "static"]
    for key, out in results.items():
        assert out.token_ids == one.token_ids and out.logprobs == one.logprobs, key


def test_pool_follows_torch_threads_unless_set(pool_settings):
    torch.set_num_threads(3)
    assert torch.ops.kiln_cpp.num_threads() == 3
    torch.ops.kiln_cpp.set_num_threads(2)
    assert torch.ops.kiln_cpp.num_threads() == 2
    torch.ops.kiln_cpp.set_num_threads(0)
    assert torch.ops.kiln_cpp.num_threads() == 3
    previous = torch.ops.kiln_cpp.serial_loops_begin()
    try:  # an engine step: the graph's loops on one thread, the kernels on three
        assert previous == 3 and torch.get_num_threads() == 1 and torch.ops.kiln_cpp.num_threads() == 3
    finally:
        torch.ops.kiln_cpp.serial_loops_end(previous)
    assert torch.get_num_threads() == 3
    with pytest.raises(RuntimeError, match="schedule must be 'dynamic' or 'static'"):
        torch.ops.kiln_cpp.set_parallel_options("guided")
    torch.ops.kiln_cpp.set_parallel_options("dynamic", 7)
    assert torch.ops.kiln_cpp.parallel_options().startswith("dynamic spin_us=7 ")


def _gemm_in_child(queue, args):
    torch.set_num_threads(1)  # libgomp is not fork-safe: OpenMP stays off in the child
    torch.ops.kiln_cpp.set_num_threads(2)  # the kernels' pool runs two threads
    queue.put(gemm.gemm(*args).tolist())  # plain data: the child exits before the parent reads


def test_forked_child_starts_its_own_pool(pool_settings):
    """The parent's pool threads do not exist in a forked child: it starts its own, and nothing waits
    for the parent's."""
    torch.set_num_threads(2)
    packed, scale, g, _ = _weights("bfloat16", 300, 128)
    args = (torch.randn(9, 128).bfloat16(), packed, scale, None, 300, g, True)
    expected = gemm.gemm(*args)  # the pool's thread running
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_gemm_in_child, args=(queue, args))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == expected.tolist()


def test_engine_step_runs_graph_loops_serially(engine, monkeypatch):
    """An aoti engine on the C++ plugins runs its compiled loops on the calling thread (its kernels on
    the pool), with the tokens of the parallel loops, and gives the caller its OpenMP threads back."""
    from kiln import LLM, SamplingParams
    from kiln.engine.loader import serial_graph_loops
    from tiny_models import PROMPTS

    path = engine("llama", "aoti", dtype="bfloat16")  # bf16: the GEMMs on the C++ plugin
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    threads = torch.get_num_threads()
    assert serial_graph_loops(path)
    serial = [o.outputs[0].token_ids for o in LLM(path).generate(PROMPTS, params)]
    assert torch.get_num_threads() == threads
    monkeypatch.setenv("KILN_GRAPH_LOOPS", "parallel")
    assert not serial_graph_loops(path)
    assert [o.outputs[0].token_ids for o in LLM(path).generate(PROMPTS, params)] == serial
    monkeypatch.setenv("KILN_GRAPH_LOOPS", "fast")
    with pytest.raises(ValueError, match="KILN_GRAPH_LOOPS must be 'serial' or 'parallel'"):
        serial_graph_loops(path)


def test_decode_gemms_learn_the_next_weight(pool_settings):
    """Each GEMV learns the weight that followed it, which the pool's waiting threads then prefetch
    (csrc/thread_pool.h); a prefill's GEMMs take no part, and prefetching changes no result."""
    from kiln.plugins import tactics

    torch.set_num_threads(2)
    a, _, _, _ = _weights("bfloat16", 300, 128)
    b, b_scale, g, _ = _weights("int4", 256, 128, seed=1)
    up, _, _, _ = _weights("bfloat16", 256, 128, seed=2)
    x = torch.randn(1, 128).bfloat16()
    ids = tactics.kernel_ids()
    fused = ids["avx512_bf16"] in torch.ops.kiln_cpp.gemm_kernels(up, torch.bfloat16)
    up_kernel = [1 << 62, ids["avx512_bf16"] if fused else ids["portable"]]  # pairs gate and up panels or not

    def step():
        return (gemm.gemm(x, a, None, None, 300), gemm.gemm(x, b, b_scale, None, 256, g),
                gemm.gemm_swiglu(x, up, None, None, 256, 0, up_kernel))

    def next_of(w):
        return tuple(torch.ops.kiln_cpp.next_weight(w))

    expected = None
    for kb in (0, 2048, 1, 2048):
        torch.ops.kiln_cpp.set_parallel_options("dynamic", 50, kb)
        out = step()
        expected = expected or out
        assert all(torch.equal(o, e) for o, e in zip(out, expected)), kb
    assert next_of(a) == (b.data_ptr(), b.nbytes, 1)
    assert next_of(b) == (up.data_ptr(), up.nbytes, 2 if fused else 1)
    assert next_of(up) == (a.data_ptr(), a.nbytes, 1)
    gemm.gemm(torch.randn(64, 128).bfloat16(), b, b_scale, None, 256, g)  # a prefill's: not learned
    gemm.gemm(x, up, None, None, 256)
    assert next_of(up) == (a.data_ptr(), a.nbytes, 1)
    assert next_of(b) == (up.data_ptr(), up.nbytes, 2 if fused else 1)
    assert torch.ops.kiln_cpp.parallel_options() == "dynamic spin_us=50 prefetch_kb=2048"
