"""A request's prompts run on the engine: one engine request per prompt, added together and awaited to
their first outputs (so that a request the engine refuses is an error status, not a broken stream),
then one stream of (prompt index, RequestOutput) merged from theirs; and a client that hangs up
before its response is ready aborts them."""
import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING

from kiln.runtime.lora_request import LoRARequest
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams
from kiln.serve.metrics import ServerMetrics
from kiln.serve.protocol import APIError

if TYPE_CHECKING:  # the runtime imports torch: loaded with the engine, after the port answers
    from kiln.runtime.frontend.async_llm import AsyncLLM

Outputs = AsyncIterator[tuple[int, RequestOutput]]


class ClientDisconnected(Exception):
    pass


async def start(llm: "AsyncLLM", metrics: ServerMetrics, prompts: list[dict], params: SamplingParams,
                request_id: str, lora: LoRARequest | None = None) -> Outputs:
    """Add one engine request per prompt (`{request_id}-{i}`); returns once each has its first output.
    The engine's refusal of any (InvalidRequestError) is raised, the others aborted."""
    gens = [metrics.track(llm.generate(p, params, f"{request_id}-{i}", lora)) for i, p in enumerate(prompts)]
    try:
        firsts = await asyncio.gather(*(g.__anext__() for g in gens), return_exceptions=True)
    except BaseException:  # cancelled (the client went away): every generate aborted its request
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        raise
    errors = [e for e in firsts if isinstance(e, BaseException)]
    if errors:
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)
        e = errors[0]
        if isinstance(e, RuntimeError) and "shut down" in str(e):
            raise APIError(503, "the server is shutting down")
        raise e
    return merge(gens, firsts)


async def merge(gens: list, firsts: list[RequestOutput]) -> Outputs:
    """One stream out of several requests' streams; closing it aborts the requests not finished."""
    tasks = []
    try:
        for i, first in enumerate(firsts):
            yield i, first
        live = [i for i, f in enumerate(firsts) if not f.finished]
        if len(live) == 1:
            async for out in gens[live[0]]:
                yield live[0], out
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i):
            try:
                async for out in gens[i]:
                    queue.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, done))

        tasks = [asyncio.ensure_future(pump(i)) for i in live]
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)


async def final_outputs(outputs: Outputs) -> list[RequestOutput]:
    """Each prompt's finished output, in prompt order (a response that is not streamed)."""
    finals = {}
    async for i, out in outputs:
        if out.finished:
            finals[i] = out
    return [finals[i] for i in sorted(finals)]


async def until_disconnected(request, work: Awaitable):
    """Await `work` unless the client hangs up first: then cancel it (its requests are aborted)
    and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)

    async def watch():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
