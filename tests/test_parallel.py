"""Multi-rank engines (tensor and pipeline parallel) against the single-rank engine of the same
weights: float32 greedy tokens identical, under in-flight batching of mixed prompt lengths with
chunked prefill, preemption and n > 1 in one run; W8A16 and FP8-KV checkpoints at TP 2 against
their TP 1 engines; torchrun with two "nodes" on loopback. And failure: a worker killed in the
middle of a step makes LLM, AsyncLLM and kiln serve fail with EngineDeadError in seconds, leaving
no process behind; a rank that cannot load fails the start with its message.

Engines are the tiny models of tests/tiny_models.py; the multi-rank ones run their ranks in worker
processes (kiln/runtime/executor/multiproc.py), whose start dominates these tests' time, so each
configuration starts once. States are reached deterministically (a worker stopped with SIGSTOP
holds the step in flight) and waited for with bounded polls."""
import asyncio
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import MODELOPT, TEST_BUILD, require
from kiln import LLM, AsyncLLM, SamplingParams
from kiln.build.builder import build_engine
from kiln.config import BuildConfig, ConfigError
from kiln.convert.cli import convert_checkpoint
from kiln.runtime.messages import EngineDeadError
from kiln.runtime.executor.multiproc import MultiprocExecutor
from kiln.utils import free_ports
from tiny_models import PROMPTS, corpus

TPB = TEST_BUILD["tokens_per_block"]
MAX_TOKENS = 24
# Every prompt over this many tokens is prefilled in chunks; 20 blocks hold the longest sequence,
# far from all of them at once (preemption).
CHUNK, KV_BLOCKS = 16, 20


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **{"max_tokens": MAX_TOKENS, **kw})


def workers(of: int | None = None) -> list[psutil.Process]:
    """Worker processes of multi-rank engines started from this process (or its engine cores)."""
    found = []
    for p in psutil.Process(of).children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and "kiln.runtime.executor.worker" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_gone(procs: list[psutil.Process], timeout: float = 30) -> None:
    gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, [p.cmdline() for p in alive]


@pytest.fixture(scope="module")
def parallel_engine(hf_model, tmp_path_factory):
    """parallel_engine(name, tp, pp, backend="eager", quant=None) -> engine dir, built once per key."""
    cache = {}

    def get(name, tp, pp, backend="eager", quant=None, quant_name=None):
        key = (name, tp, pp, backend, quant_name)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"{name}_tp{tp}_pp{pp}_{backend}")
            ckpt = convert_checkpoint(hf_model(name), root / "ckpt", dtype="float32", tp_size=tp, pp_size=pp,
                                      quant=quant)
            cache[key] = build_engine(ckpt, root / "engine", BuildConfig(**{**TEST_BUILD, "backend": backend}),
                                      log=lambda *_: None, workers=2 if tp * pp > 1 and backend == "aoti" else 1)
        return cache[key]

    return get


def batched_run(engine_dir) -> tuple[list[list[list[int]]], list[float], int]:
    """Every prompt at once, prompt 0 with n = 2 and prompt 3 with prompt logprobs (more logits than
    a decode step's), in a small token budget and KV cache: (tokens per sample, prompt logprobs,
    the most steps that were in flight at once)."""
    llm = LLM(engine_dir, max_num_tokens=CHUNK, max_tokens_in_paged_kv_cache=KV_BLOCKS * TPB)
    try:
        core = llm.llm_engine.core
        in_flight = [1]
        collect = getattr(core.executor, "collect", None)
        if collect is not None:  # multi-rank: count the steps in flight each time one is collected
            def counted():
                in_flight.append(len(core.batch_queue) + 1)
                return collect()
            core.executor.collect = counted
        params = [greedy(n=2)] + [greedy()] * (len(PROMPTS) - 1)
        params[3] = greedy(prompt_logprobs=1)
        outs = llm.generate(PROMPTS, params)
        lens = [len(o.prompt_token_ids) for o in outs]
        assert max(lens) > CHUNK and min(lens) < CHUNK  # mixed lengths, some chunked
        assert core.scheduler.counters.num_preemptions > 0
        assert core.kv.pool.num_free == core.kv.pool.num_blocks
        # Each prompt token's logprob (the top-1 alternatives could swap at a near tie).
        scored = [lp[t] for t, lp in zip(outs[3].prompt_token_ids[1:], outs[3].prompt_logprobs[1:])]
        return [[c.token_ids for c in o.outputs] for o in outs], scored, max(in_flight)
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = batched_run(engine(name))
        return cache[name]

    return get


# ------------------------------------------------------------------------------ same tokens
@pytest.mark.parametrize("name,tp,pp,backend", [
    ("llama", 2, 1, "eager"),  # GQA, tied embeddings: vocab-parallel embedding and lm_head
    ("llama", 1, 2, "eager"),
    ("llama", 2, 1, "aoti"),  # the all-reduces compiled in
    ("qwen2", 2, 2, "eager"),  # qkv bias split with the heads
    ("llama_linear", 2, 1, "eager"),  # one KV head, replicated on both ranks; untied lm_head
    ("olmo2", 2, 1, "eager"),  # q/k norms over whole projections split over the ranks, the one KV head on both
    ("granite", 1, 2, "eager"),  # the embedding multiplier on the first stage only
])
def test_same_tokens_as_one_rank(parallel_engine, reference, name, tp, pp, backend):
    engine_dir = parallel_engine(name, tp, pp, backend)
    assert sorted(p.name for p in engine_dir.glob("rank*.engine")) == [f"rank{r}.engine" for r in range(tp * pp)]
    before = workers()
    tokens, prompt_logprobs, in_flight = batched_run(engine_dir)
    want_tokens, want_logprobs, _ = reference(name)
    assert tokens == want_tokens
    assert prompt_logprobs == pytest.approx(want_logprobs, abs=1e-4)
    assert in_flight == pp  # pipeline parallel: a step per stage at once (the batch queue)
    wait_gone([p for p in workers() if p not in before])


def test_abort_while_in_flight(parallel_engine, reference):
    """PP=2: a request aborted while its step is still in the pipeline gives its blocks back at once;
    when that step's logits come back they are dropped, and the request beside it keeps its tokens."""
    from kiln.runtime.frontend.llm_engine import LLMEngine

    want = reference("llama")[0]
    engine = LLMEngine(parallel_engine("llama", 1, 2))
    try:
        core = engine.core
        engine.add_request(PROMPTS[0], greedy(), "gone")
        assert engine.step() == [] and len(core.batch_queue) == 1  # in the pipeline, nothing back yet
        assert engine.abort("gone").outputs[0].finish_reason == "abort"
        assert core.kv.pool.num_free == core.kv.pool.num_blocks
        engine.add_request(PROMPTS[1], greedy(), "kept")
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert {o.request_id for o in outs} == {"kept"}
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == want[1][0]
        assert core.kv.pool.num_free == core.kv.pool.num_blocks
    finally:
        engine.shutdown()


def test_micro_batches_share_the_batch(parallel_engine):
    """PP=2 with more requests waiting than the batch holds: each step in flight takes half the
    batch, so that the second stage has a step of its own to work on."""
    from kiln.runtime.frontend.llm_engine import LLMEngine

    engine = LLMEngine(parallel_engine("llama", 1, 2), max_batch_size=4)
    try:
        core = engine.core
        for i in range(10):
            engine.add_request({"prompt_token_ids": [5 + i, 6, 7]}, greedy(max_tokens=3))
        sizes = []
        while engine.has_unfinished_requests():
            engine.step()
            sizes.append([len(step.out.scheduled) for step in core.batch_queue])
        assert sizes[0] == [2] and sizes[1] == [2]  # the first two steps: 2 of the 4 batch slots each
        assert max(len(s) for s in sizes) == 1 and core.kv.pool.num_free == core.kv.pool.num_blocks
    finally:
        engine.shutdown()


def _fp8_kv(tmp_path_factory):
    require(*MODELOPT)
    from kiln.convert.quantize.pipeline import QuantOptions

    calib = tmp_path_factory.mktemp("calib") / "calib.txt"
    calib.write_text("\n\n".join(corpus()))
    return QuantOptions(None, "fp8", calib_dataset=calib, calib_size=8, calib_max_seq_len=64, eval_size=1)


def _int8_wo(tmp_path_factory):
    from kiln.convert.quantize.pipeline import QuantOptions

    return QuantOptions("int8_wo")


@pytest.mark.parametrize("make", [_int8_wo, _fp8_kv], ids=["W8A16", "FP8_KV"])
def test_quantized_tp2_same_tokens_as_tp1(parallel_engine, tmp_path_factory, make):
    quant = make(tmp_path_factory)
    tokens = []
    for tp in (1, 2):
        llm = LLM(parallel_engine("llama", tp, 1, quant=quant, quant_name=make.__name__))
        tokens.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())])
        llm.llm_engine.shutdown()
    assert tokens[0] == tokens[1]


# ------------------------------------------------------------------------------ torchrun

def wait_healthy(url: str, procs: list, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"exited early:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"not healthy:\n{log.read_text()}")


def complete(url: str, model: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_torchrun_two_nodes_same_tokens(parallel_engine, engine, tmp_path):
    """Two torchrun launchers on loopback, one rank each: rank 0 serves, rank 1 runs its engine;
    across "nodes" the TP all-reduces go through gloo. SIGTERM to the server ends both cleanly."""
    engine_dir = parallel_engine("llama", 2, 1)
    ref = LLM(engine("llama")).generate([PROMPTS[0], PROMPTS[2]], greedy())
    port, master = free_ports(2)
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
         str(node), "--master-addr", "127.0.0.1", "--master-port", str(master), "-m", "kiln.launch", "serve",
         "--engine_dir", str(engine_dir), "--host", "127.0.0.1", "--port", str(port), "--no_access_log",
         "--max_tokens_in_paged_kv_cache", "512"],
        stdout=open(tmp_path / f"node{node}.log", "w"), stderr=subprocess.STDOUT) for node in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, launchers, tmp_path / "node0.log")
        for prompt, want in zip([PROMPTS[0], PROMPTS[2]], ref):
            r = complete(url, str(engine_dir), prompt)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == want.outputs[0].token_ids
        (server,) = [p for p in psutil.Process(launchers[0].pid).children() if "kiln.launch" in p.cmdline()]
        server.send_signal(signal.SIGTERM)
        assert [p.wait(120) for p in launchers] == [0, 0], (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        for p in launchers:
            if p.poll() is None:
                p.kill()
                p.wait()


# ------------------------------------------------------------------------------ failure
def stop_rank(executor: MultiprocExecutor, rank: int) -> psutil.Process:
    """Freeze a worker: the next step waits for it in its first collective."""
    victim = psutil.Process(executor.procs[rank].pid)
    victim.suspend()
    return victim


def test_killed_worker_fails_llm_fast(parallel_engine):
    llm = LLM(parallel_engine("llama", 2, 1), max_tokens_in_paged_kv_cache=512)
    engine, procs = llm.llm_engine, workers()
    engine.add_request(PROMPTS[0], greedy(max_tokens=100))
    for _ in range(3):  # generating
        engine.step()
    victim = stop_rank(engine.core.executor, 1)
    errors = []

    def step():
        try:
            while True:
                engine.step()
        except Exception as e:  # noqa: BLE001
            errors.append((time.monotonic(), e))

    thread = threading.Thread(target=step)
    thread.start()
    time.sleep(0.3)  # the step is in flight, waiting for rank 1 (or about to: either way it must fail)
    victim.kill()
    killed = time.monotonic()
    thread.join(30)
    (when, error), = errors
    assert isinstance(error, EngineDeadError) and when - killed < 5
    assert f"rank 1 (pid {victim.pid}) was killed by SIGKILL" in str(error)
    with pytest.raises(EngineDeadError, match="was killed by SIGKILL"):  # sticky: every later request fails
        llm.generate(PROMPTS[:2], greedy())
    wait_gone(procs, timeout=10)
    llm.llm_engine.shutdown()


def test_killed_worker_fails_async_llm_fast(parallel_engine):
    async def main():
        llm = AsyncLLM(parallel_engine("llama", 2, 1), max_tokens_in_paged_kv_cache=512)
        procs = workers()
        assert len(procs) == 2
        seen, killed = 0, None
        with pytest.raises(EngineDeadError, match="rank 1 .* was killed by SIGKILL"):
            async for _ in llm.generate(PROMPTS[0], greedy(max_tokens=150)):
                seen += 1
                if seen == 3:
                    procs[1].kill()
                    killed = time.monotonic()
        assert time.monotonic() - killed < 5
        with pytest.raises(EngineDeadError):
            async for _ in llm.generate(PROMPTS[1], greedy()):
                pass
        llm.shutdown()
        wait_gone(procs, timeout=10)

    asyncio.run(main())


def test_killed_worker_fails_kiln_serve_fast(parallel_engine, tmp_path):
    """/health is never 200 again, the stream in flight ends with an error, the server exits 1
    within 10 s, and no process of its tree is left."""
    engine_dir = parallel_engine("llama", 2, 1)
    port, log = free_ports(1)[0], tmp_path / "server.log"
    server = subprocess.Popen([str(Path(sys.executable).parent / "kiln"), "serve", "--engine_dir", str(engine_dir),
                               "--host", "127.0.0.1", "--port", str(port), "--no_access_log",
                               "--max_tokens_in_paged_kv_cache", "512"], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [server], log)
        tree = psutil.Process(server.pid).children(recursive=True)
        ranks = workers(server.pid)
        assert len(ranks) == 2
        body = {"model": str(engine_dir), "prompt": PROMPTS[0], "max_tokens": 150, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            ranks[1].kill()
            killed = time.monotonic()
            rest = list(lines)
        assert any("server_error" in line for line in rest) and rest[-2:] == ["data: [DONE]", ""]
        health = []
        while server.poll() is None and time.monotonic() - killed < 10:
            try:
                health.append(httpx.get(f"{url}/health", timeout=1).status_code)
            except httpx.TransportError:
                break
            time.sleep(0.05)
        assert server.wait(timeout=max(0.1, 10 - (time.monotonic() - killed))) == 1
        assert set(health) <= {503}
        assert f"rank 1 (pid {ranks[1].pid}) was killed by SIGKILL: /health is 503" in log.read_text()
        wait_gone(tree, timeout=10)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_rank_failing_to_load_fails_the_start(parallel_engine, tmp_path):
    broken = tmp_path / "engine"
    shutil.copytree(parallel_engine("llama", 2, 1), broken)
    data = (broken / "rank1.engine").read_bytes()
    (broken / "rank1.engine").write_bytes(data[: len(data) // 2])
    before = workers()
    with pytest.raises(ConfigError, match=r"failed to load rank 1 \(pid \d+\): .*rank1.engine is not a loadable"):
        LLM(broken)
    assert workers() == before


def test_worker_dying_while_idle_is_noticed(parallel_engine):
    """No request in flight: the engine core's idle wait watches the workers too."""
    died = []
    llm = AsyncLLM(parallel_engine("llama", 1, 2), max_tokens_in_paged_kv_cache=512, on_dead=died.append)
    procs = workers()
    procs[0].kill()
    deadline = time.monotonic() + 10
    while llm.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(llm.dead, EngineDeadError) and died == [llm.dead]
    assert f"rank 0 (pid {procs[0].pid}) was killed by SIGKILL" in str(llm.dead)
    llm.shutdown()
    wait_gone(procs, timeout=10)
