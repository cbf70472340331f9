"""`AsyncLLM`: asyncio streaming over one engine core stepping in a background thread."""
import asyncio
import contextlib
import itertools
import threading
from collections.abc import AsyncIterator

from kiln.runtime.llm_engine import LLMEngine
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


class AsyncLLM:
    def __init__(self, engine_dir, **engine_args):
        self.llm_engine = LLMEngine(engine_dir, **engine_args)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        # Callers waiting for the lock; the engine thread lets them in between two steps
        # (threading.Lock is not fair: the stepping thread would take it back at once).
        self._callers = 0
        self._callers_lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
        self._thread.start()

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput (cumulative text and tokens) each step the request advances.
        Closing the iterator early (or cancelling its task) aborts the request."""
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        # Adding waits for the step in progress: wait in a worker thread, not on the event loop
        # (a server adding many requests would otherwise stall every stream for a step each).
        added = loop.run_in_executor(None, self._add, prompt, sampling_params, request_id, loop, queue)
        finished = False
        try:
            await asyncio.shield(added)
            while not finished:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                if not added.done():  # cancelled while being added: abort it once it is in
                    added.add_done_callback(lambda f: f.exception() is None and self.abort(request_id))
                elif added.exception() is None:  # abort waits for the step in progress: off the loop too
                    await loop.run_in_executor(None, self.abort, request_id)

    def _add(self, prompt, sampling_params, request_id, loop, queue) -> None:
        with self._locked():
            if self._stopped:
                raise RuntimeError("AsyncLLM is shut down")
            self.llm_engine.add_request(prompt, sampling_params, request_id)
            self._streams[request_id] = (loop, queue)
            self._work.notify()

    def stats(self) -> dict:
        """A consistent snapshot of the engine's load (LLMEngine.get_stats), taken between steps."""
        with self._locked():
            return self.llm_engine.get_stats()

    def abort(self, request_id: str) -> None:
        with self._locked():
            out = self.llm_engine.abort(request_id)
            if out is not None:
                try:
                    self._deliver(request_id, out)  # the stream ends with finish_reason "abort"
                except RuntimeError:  # its event loop is closed; nobody is listening
                    pass
            self._streams.pop(request_id, None)

    def abort_all(self) -> list[str]:
        """Abort every request (e.g. a server's drain ran out of time): each stream ends with
        finish_reason "abort". Returns the ids aborted."""
        with self._locked():
            ids = list(self.llm_engine.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def shutdown(self) -> None:
        with self._locked():
            self._stopped = True
            self._work.notify()
        self._thread.join()

    @contextlib.contextmanager
    def _locked(self):
        with self._callers_lock:
            self._callers += 1
        with self._lock:
            with self._callers_lock:
                self._callers -= 1
            try:
                yield
            finally:
                self._work.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (self._callers or not self.llm_engine.has_unfinished_requests()):
                    self._work.wait()
                if self._stopped:
                    return
                try:
                    outputs = self.llm_engine.step()
                except Exception as e:  # fail every request in flight, keep the loop alive
                    outputs = []
                    for rid in list(self._streams):
                        self.llm_engine.abort(rid)
                        self._deliver(rid, e)
                for out in outputs:
                    self._deliver(out.request_id, out)

    def _deliver(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        loop, queue = stream
        if getattr(item, "finished", True):
            del self._streams[request_id]
        loop.call_soon_threadsafe(queue.put_nowait, item)
