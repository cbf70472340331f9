"""What both `tensorrt_llm` models (the inflight_batcher_llm layout's and the llmapi layout's) do
alike: one in-process AsyncLLM that every request shares, an asyncio loop in a thread of its own
that runs the requests (and the model's `_watch` for cancelled ones), and a thread that copies the
engine's load into Triton's metrics every `stats_period` seconds."""
import asyncio
import itertools
import threading
import time

import triton_python_backend_utils as pb_utils


class EngineHost:
    def start(self, llm, metrics, stats_period: float, name: str) -> None:
        self.llm, self.metrics, self.stats_period = llm, metrics, stats_period
        self.jobs: dict = {}
        self.ids = itertools.count()
        self.running = True
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self._run_loop, name=f"{name}-loop", daemon=True)
        self.loop_thread.start()
        self.stats_thread = threading.Thread(target=self._stats_loop, name=f"{name}-stats", daemon=True)
        self.stats_thread.start()

    def finalize(self):
        self.running = False
        asyncio.run_coroutine_threadsafe(self._cancel_all(), self.loop).result(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(timeout=30)
        self.stats_thread.join(timeout=30)
        self.llm.shutdown()

    async def _watch(self) -> None:
        raise NotImplementedError

    async def _cancel_all(self) -> None:
        raise NotImplementedError

    def _run_loop(self):
        asyncio.set_event_loop(self.loop)
        self.watcher = self.loop.create_task(self._watch())
        self.loop.run_forever()

    def _count(self, out) -> None:
        m = out.metrics
        self.metrics.finished(len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                              m.time_to_first_token if m else None)

    def _stats_loop(self) -> None:
        while self.running:
            time.sleep(self.stats_period)
            try:
                self.metrics.update(self.llm.stats(), time.time())
            except Exception as e:  # noqa: BLE001 - metrics must never take the model down
                pb_utils.Logger.log_warn(f"tensorrt_llm: metrics update failed: {e}")
