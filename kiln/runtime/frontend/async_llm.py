"""`AsyncLLM`: asyncio streaming over an engine core that runs in a process of its own.

The core's busy loop (kiln/runtime/core/core_process.py, run_engine_core) never waits for this side: requests and aborts go
to it through a pipe, and a reader thread here turns each step's token ids into text and
`RequestOutput`s and hands them to the streams' event loops, while the core takes the next step.
If the core dies, every stream and every later call fails with `EngineDeadError`.
"""
import asyncio
import copy
import itertools
import threading
from collections.abc import AsyncIterator

from kiln.runtime.frontend.core_client import BackgroundClient
from kiln.runtime.frontend.input_processor import InputProcessor
from kiln.runtime.frontend.output_processor import OutputProcessor
from kiln.runtime.frontend.tokenizer import eos_token_ids, frontend_tokenizer
from kiln.runtime.messages import EngineDeadError, IterationStats, SchedulerStats, stats_dict
from kiln.runtime.outputs import RequestOutput
from kiln.runtime.sampling_params import SamplingParams


class AsyncLLM:
    """Keyword arguments go to the engine core, as for `LLM`; `engine_core="thread"` runs the core's
    loop in a thread of this process instead (one process, for environments that cannot spawn)."""

    def __init__(self, engine_dir, *, engine_core: str = "process", tokenizer=None, skip_tokenizer_init: bool = False,
                 on_dead=None, **core_args):
        self.on_dead = on_dead  # called (from the reader thread) with the EngineDeadError, once
        self._closing = False
        self.tokenizer = frontend_tokenizer(engine_dir, tokenizer, skip_tokenizer_init)
        self.client = BackgroundClient(engine_dir, engine_core, **core_args)
        info = self.client.info
        self.build_config, self.model_config, self.threads = info.build_config, info.model_config, info.threads
        self.input_processor = InputProcessor(info, self.tokenizer, eos_token_ids(self.model_config, self.tokenizer))
        # The reader thread detokenizes with a tokenizer of its own: a fast tokenizer used by two
        # threads at once can fail ("Already borrowed") while the other one encodes.
        self.output_processor = OutputProcessor(copy.deepcopy(self.tokenizer), self.build_config.max_seq_len)
        # Guards the output processor and the streams between the reader thread and callers.
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stats = None
        self._dead: EngineDeadError | None = None
        self._ids = itertools.count()
        self._reader = threading.Thread(target=self._read_outputs, name="kiln-outputs", daemon=True)
        self._reader.start()

    @property
    def dead(self) -> EngineDeadError | None:
        """The error that stopped the engine core, or None while it runs."""
        return self._dead

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request=None) -> AsyncIterator[RequestOutput]:
        """Yields a RequestOutput (cumulative text and tokens) each step the request advances (the
        latest, when several steps went by since the caller last asked).
        Closing the iterator early (or cancelling its task) aborts the request."""
        request_id = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        queue: asyncio.Queue = asyncio.Queue()
        core_request, state = self.input_processor.process(request_id, prompt, sampling_params, lora_request)
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if request_id in self.output_processor.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.output_processor.add(state)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        finished = False
        try:
            self.client.add_request(core_request)
            while not finished:
                out = await queue.get()
                # A caller that fell behind gets the latest output (each is cumulative): one response
                # for the steps it missed rather than a backlog, as vLLM's output collector merges them
                while not queue.empty() and not isinstance(out, BaseException) and not out.finished:
                    out = queue.get_nowait()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """End the request: its stream ends with finish_reason "abort"; its KV blocks are freed as
        soon as the core reads the abort. Unknown or finished ids are ignored."""
        request_id = str(request_id)
        with self._lock:
            out = self.output_processor.abort(request_id)
            stream = self._streams.pop(request_id, None)
        if out is None:
            return
        self.client.abort(request_id)
        if stream is not None:
            _deliver(stream[0], [(stream[1], out)])

    def abort_all(self) -> list[str]:
        """Abort every request (a server's drain ran out of time); returns the ids aborted."""
        with self._lock:
            ids = list(self.output_processor.requests)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def stats(self) -> dict:
        """The engine's load as of its last step (requests running and waiting, KV blocks): the core
        sends it with every step's outputs, so reading it never waits for a step."""
        with self._lock:
            stats = self._stats
        if stats is None:  # no step yet
            n = self.client.info.num_kv_blocks
            stats = SchedulerStats(0, 0, n, n, 0.0, 0, iterations=IterationStats())
        return stats_dict(stats)

    def shutdown(self) -> None:
        self.on_dead = None  # the core stopping now is no death
        self._closing = True
        self.client.shutdown()
        self._reader.join(10)

    def _read_outputs(self) -> None:
        while True:
            try:
                core_outputs = self.client.get_outputs()
            except EngineDeadError as e:
                self._fail_all(e)
                return
            except Exception as e:  # noqa: BLE001 - the pipe was closed by shutdown(), or a broken message
                self._fail_all(EngineDeadError("the engine core was shut down" if self._closing else
                                               f"the engine core's outputs could not be read: {type(e).__name__}: {e}"))
                return
            by_loop: dict[asyncio.AbstractEventLoop, list] = {}
            with self._lock:
                self._stats = core_outputs.stats
                outputs, stopped = self.output_processor.process(core_outputs.outputs)
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream is not None:
                        if out.finished:
                            del self._streams[out.request_id]
                        by_loop.setdefault(stream[0], []).append((stream[1], out))
                for ids, message in core_outputs.errors:
                    for rid in ids:
                        self.output_processor.abort(rid)
                        stream = self._streams.pop(rid, None)
                        if stream is not None:
                            by_loop.setdefault(stream[0], []).append((stream[1], RuntimeError(message)))
            for request_id, index in stopped:
                self.client.abort(request_id, index)
            for loop, items in by_loop.items():
                _deliver(loop, items)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
            streams = list(self._streams.values())
            self._streams.clear()
            self.output_processor.requests.clear()
        if self.on_dead is not None:  # before the streams hear of it: whoever sees one fail sees this done
            self.on_dead(self._dead)
        by_loop: dict = {}
        for loop, queue in streams:
            by_loop.setdefault(loop, []).append((queue, self._dead))
        for loop, items in by_loop.items():
            _deliver(loop, items)


def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Hand outputs to their streams' queues on the streams' own event loop, in one wake-up."""
    def put():
        for queue, item in items:
            queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put)
    except RuntimeError:  # that event loop is closed: nobody is listening
        pass
