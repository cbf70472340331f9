"""AsyncLLM (its core in a process of its own) on a tiny random Llama: a stream per request with an
output per step, concurrent requests giving the reference's tokens, aborts (closing a stream early,
`abort`) giving every block back, and a dead core failing every stream with EngineDeadError."""
import asyncio
import time

import pytest

from kiln import AsyncLLM
from runtime_helpers import MAX_TOKENS, greedy, tokens
from runtime_helpers import engine_dir, llm, reference, tok  # noqa: F401 - fixtures
from tiny_models import PROMPTS


def room(llm, prompt: str) -> int:
    """The most tokens the engine lets this prompt generate: a request that stays in flight longest."""
    return llm.build_config.max_seq_len - len(llm.tokenizer.encode(prompt))


def assert_async_blocks_free(async_llm: AsyncLLM) -> None:
    """The core (another process) frees blocks when it reads an abort: wait for its stats to say so."""
    deadline = time.monotonic() + 30
    while True:
        s = async_llm.stats()
        if s["num_free_kv_blocks"] == s["num_kv_blocks"] and not s["num_requests_running"] + s["num_requests_waiting"]:
            break
        assert time.monotonic() < deadline, s
        time.sleep(0.01)
    assert not async_llm.output_processor.requests


@pytest.fixture(scope="module")
def async_llm(engine_dir):
    a = AsyncLLM(engine_dir)
    yield a
    a.shutdown()


def test_async_streaming(async_llm, reference, tok):
    async def stream():
        return [o async for o in async_llm.generate(PROMPTS[3], greedy())]

    outs = asyncio.run(stream())
    # An output per step, unless the stream fell behind the core: then the latest one (DESIGN.md).
    assert 1 < len(outs) <= MAX_TOKENS
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    lens = [len(o.outputs[0].token_ids) for o in outs]
    assert lens == sorted(lens) and lens[-1] == MAX_TOKENS
    final = outs[-1].outputs[0]
    assert final.token_ids == reference[3].outputs[0].token_ids and final.finish_reason == "length"
    for o in outs:
        assert final.text.startswith(o.outputs[0].text)
        assert final.token_ids[:len(o.outputs[0].token_ids)] == o.outputs[0].token_ids
    assert final.text == tok.decode(final.token_ids, skip_special_tokens=True)
    assert outs[-1].metrics.time_to_first_token > 0 and outs[-1].metrics.time_per_output_token > 0


def test_async_concurrent(async_llm, reference):
    async def one(prompt):
        last = None
        async for out in async_llm.generate(prompt, greedy()):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    outs = asyncio.run(main())
    assert tokens(outs) == tokens(reference)
    assert len({o.request_id for o in outs}) == len(PROMPTS)
    assert_async_blocks_free(async_llm)


def test_async_close_early_aborts(async_llm):
    async def main():
        gen = async_llm.generate(PROMPTS[0], greedy(room(async_llm, PROMPTS[0])), request_id="early")
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()
        return got

    got = asyncio.run(main())
    assert not got[-1].finished
    assert "early" not in async_llm.output_processor.requests
    assert_async_blocks_free(async_llm)


def test_async_abort(async_llm):
    # In flight for every step the engine allows it: far longer than the 2-token request beside it.
    max_tokens = room(async_llm, PROMPTS[1])

    async def main():
        started = asyncio.Event()
        outs = []

        async def consume():
            async for out in async_llm.generate(PROMPTS[1], greedy(max_tokens), request_id="to-abort"):
                outs.append(out)
                started.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(started.wait(), 30)
        # a new request gets into the busy engine and finishes while the long one still runs
        short = [o async for o in async_llm.generate(PROMPTS[4], greedy(2))]
        assert short[-1].finished and len(short[-1].outputs[0].token_ids) == 2
        assert "to-abort" in async_llm.output_processor.requests
        async_llm.abort("to-abort")
        await asyncio.wait_for(task, 10)  # the stream ends; its consumer is not left waiting
        return outs

    outs = asyncio.run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < max_tokens
    assert_async_blocks_free(async_llm)
    async_llm.abort("to-abort")  # unknown or finished ids are ignored


def test_dead_engine_core_is_a_sticky_error(engine_dir):
    """Killing the core process fails the stream in flight and every later request with
    EngineDeadError, at once instead of hanging."""
    import os
    import signal

    from kiln.runtime.messages import EngineDeadError

    a = AsyncLLM(engine_dir)
    deaths = []
    a.on_dead = deaths.append

    async def main():
        gen = a.generate(PROMPTS[0], greedy(room(a, PROMPTS[0])))
        await gen.__anext__()
        os.kill(a.client.pid, signal.SIGKILL)

        async def drain():  # outputs of steps done before the kill come first, then the error
            while True:
                await gen.__anext__()

        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(drain(), 10)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(a.generate(PROMPTS[1], greedy()).__anext__(), 10)

    try:
        asyncio.run(main())
        assert len(deaths) == 1 and a.dead is deaths[0]
    finally:
        a.shutdown()
