"""The `tensorrt_llm` model: one in-process AsyncLLM per model instance, so that every client's
requests share one in-flight batch.

`execute` only hands requests over: an asyncio loop in a thread of its own runs each one (a task
per batch row, streaming from AsyncLLM.generate) and answers through the request's response
sender. Cancellation: every `cancellation_check_period_ms` the loop looks for requests Triton has
cancelled (a gRPC stream stopped with cancel_requests, a closed HTTP connection) and drops their
streams, which aborts them in the engine; a request with `stop` true aborts the requests in flight
under its request id, which then end with the tokens they have."""
import asyncio
import contextlib
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton_python_backend_utils as pb_utils

from kiln.config import EngineConfig
from kiln.triton_backend import parameters, upstream
from kiln.triton_backend.engine_host import EngineHost
from kiln.triton_backend.engine_io import RequestError, Row, Tracker, merge, parse_request
from kiln.triton_backend.metrics import EngineMetrics

PARAMS = ["gpt_model_path", "gpt_model_type", "batch_scheduler_policy", "max_tokens_in_paged_kv_cache",
          "kv_cache_free_gpu_mem_fraction", "enable_chunked_context", "enable_kv_cache_reuse",
          "exclude_input_in_output", "max_beam_width", "cancellation_check_period_ms", "stats_check_period_ms",
          "decoding_mode"]
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


@dataclass
class Job:
    """One Triton request in flight."""
    triton_id: str
    sender: object
    wanted: set
    rows: list[Row]
    engine_ids: list[str]
    trackers: list[Tracker] = field(default_factory=list)
    tasks: list[asyncio.Task] = field(default_factory=list)
    remaining: int = 0
    finals: list[dict] = field(default_factory=list)  # non-decoupled: the rows' answers, sent together
    done: bool = False


class TritonPythonModel(EngineHost):
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """Triton's auto-complete (on unless the server disables it): a config that leaves out the
        inputs and outputs, as configs written for TensorRT-LLM's backend may, gets Kiln's."""
        return upstream.complete_io(auto_complete_model_config)

    def initialize(self, args):
        from kiln.runtime.frontend.async_llm import AsyncLLM  # here: Triton may import this module just to read its config

        config = json.loads(args["model_config"])
        try:
            if config.get("backend") == upstream.BACKEND:  # a config written for TensorRT-LLM's own backend
                p, notes = upstream.read_parameters(config.get("parameters", {}), PARAMS)
                for note in notes:
                    pb_utils.Logger.log_info(f"{args['model_name']}: {note}")
            else:
                p = parameters.read(config.get("parameters", {}), PARAMS)
        except parameters.ParamError as e:
            raise pb_utils.TritonModelException(f"{args['model_name']}: {e}") from None
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.exclude_input = p["exclude_input_in_output"]
        self.cancel_period = p["cancellation_check_period_ms"] / 1000
        engine = EngineConfig.load(p["gpt_model_path"])
        self.max_beam_width = p["max_beam_width"]
        if self.max_beam_width > engine.build_config.max_beam_width:
            raise pb_utils.TritonModelException(
                f"tensorrt_llm: parameter max_beam_width ({self.max_beam_width}) exceeds the engine's "
                f"({engine.build_config.max_beam_width}); rebuild it with engine-build --max_beam_width")
        self.vocab_size = engine.pretrained_config.vocab_size
        self.tokens_per_block = engine.build_config.tokens_per_block
        self.llm = AsyncLLM(p["gpt_model_path"], scheduler_policy=p["batch_scheduler_policy"],
                            enable_chunked_prefill=p["enable_chunked_context"],
                            enable_prefix_caching=p["enable_kv_cache_reuse"],
                            kv_cache_free_mem_fraction=p["kv_cache_free_gpu_mem_fraction"],
                            max_tokens_in_paged_kv_cache=p["max_tokens_in_paged_kv_cache"],
                            speculative_config={"method": "eagle3"} if p.get("decoding_mode") == "eagle" else None)
        self.tokenizer = self.llm.tokenizer
        # LoRA adapters by lora_task_id, each written where its first request's weights came in
        self.lora_tasks: dict[int, object] = {}
        self.lora_root = tempfile.TemporaryDirectory(prefix="kiln-lora-tasks-")
        self.start(self.llm, EngineMetrics(args["model_name"], args["model_version"],
                                           engine.build_config.max_batch_size, self.tokens_per_block),
                   p["stats_check_period_ms"] / 1000, "kiln-triton")

    # -- Triton's calls ------------------------------------------------------------------------
    def finalize(self):
        super().finalize()
        self.lora_root.cleanup()

    def execute(self, requests):
        for request in requests:
            tensors = {t.name(): t.as_numpy() for t in request.inputs()}
            args = (request.request_id(), request.get_response_sender(), set(request.requested_output_names()),
                    tensors)
            asyncio.run_coroutine_threadsafe(self._serve(*args), self.loop)
        return None

    # -- the loop ------------------------------------------------------------------------------
    async def _serve(self, triton_id: str, sender, wanted: set, tensors: dict) -> None:
        try:
            stop, rows = parse_request(tensors, decoupled=self.decoupled, exclude_input_default=self.exclude_input,
                                       vocab_size=self.vocab_size, tokenizer=self.tokenizer,
                                       max_beam_width=self.max_beam_width)
        except RequestError as e:
            return self._send_error(sender, str(e))
        except Exception as e:  # noqa: BLE001 - a bug here must still answer, never leave the client waiting
            return self._send_error(sender, f"{type(e).__name__}: {e}")
        if stop:
            await self._stop(triton_id, sender)
            return
        try:
            loras = [self._lora(row) for row in rows]
        except (RequestError, ValueError) as e:
            return self._send_error(sender, str(e))
        key = next(self.ids)
        job = Job(triton_id, sender, wanted, rows, [f"trt-{key}-{b}" for b in range(len(rows))])
        job.remaining = len(rows)
        self.jobs[key] = job
        try:
            streams = [self.llm.generate({"prompt_token_ids": row.prompt}, row.params, rid, lora)
                       for row, rid, lora in zip(rows, job.engine_ids, loras)]
            # every row added (or refused) before any response: a bad row fails the whole request
            firsts = await asyncio.gather(*(s.__anext__() for s in streams), return_exceptions=True)
            errors = [e for e in firsts if isinstance(e, BaseException)]
            if errors or job.done:  # refused, or cancelled meanwhile (then the final flag is sent)
                await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
                if not job.done:
                    self._send_error(sender, str(errors[0]) or type(errors[0]).__name__)
                return
            job.trackers = [Tracker(row, b, self.tokens_per_block, self.vocab_size) for b, row in enumerate(rows)]
            job.tasks = [asyncio.ensure_future(self._row(job, t, s, f))
                         for t, s, f in zip(job.trackers, streams, firsts)]
            results = await asyncio.gather(*job.tasks, return_exceptions=True)
            failed = [r for r in results if isinstance(r, Exception)]
            if failed and not job.done:
                self._send_error(sender, f"{type(failed[0]).__name__}: {failed[0]}")
        except asyncio.CancelledError:
            pass
        finally:
            self.jobs.pop(key, None)

    def _lora(self, row):
        """The row's adapter: cached under its lora_task_id by the first request that sent its weights
        and config (TensorRT-LLM's format; weights sent again for a cached id are not read again)."""
        from kiln.lora.adapter import check_adapter, from_trtllm, save_trtllm
        from kiln.runtime.lora_request import LoRARequest

        task = row.lora_task_id
        if task is None:
            return None
        info = self.llm.input_processor.info
        if info.build_config.lora_config is None:
            raise RequestError(f"lora_task_id {task}: the engine was built without adapters "
                               f"(engine-build --lora_plugin auto --lora_target_modules ...)")
        if task not in self.lora_tasks:
            if row.lora_weights is None:
                raise RequestError(f"lora_task_id {task} is not cached: send lora_weights and lora_config with "
                                   f"its first request")
            source = f"lora_task_id {task}: lora_weights / lora_config"
            try:  # checked before it is written, so that the error names the inputs
                adapter = from_trtllm(source, row.lora_weights, row.lora_config, info.model_config)
                check_adapter(adapter, info.model_config, info.build_config.lora_config)
            except ValueError as e:
                raise RequestError(str(e)) from None
            path = Path(self.lora_root.name) / str(task)
            path.mkdir(exist_ok=True)
            save_trtllm(path, row.lora_weights, row.lora_config)
            self.lora_tasks[task] = LoRARequest(f"lora_task_{task}", task, str(path))
        return self.lora_tasks[task]

    async def _row(self, job: Job, tracker: Tracker, stream, first) -> None:
        out = first
        async with contextlib.aclosing(stream):
            while True:
                responses = tracker.update(out)
                if out.finished:
                    job.remaining -= 1
                    self._count(out)
                last = out.finished and job.remaining == 0
                if self.decoupled:
                    for i, tensors in enumerate(responses):
                        self._send(job, tensors, final=last and i == len(responses) - 1)
                    if last and not responses:
                        self._send(job, None, final=True)
                else:
                    job.finals.extend(responses)
                    if last:
                        self._send(job, merge(job.finals, job.rows[0].pad_id), final=True)
                if out.finished:
                    return
                out = await stream.__anext__()

    def _send(self, job: Job, tensors: dict | None, final: bool) -> None:
        if job.done:
            return
        response = None
        if tensors is not None:
            response = pb_utils.InferenceResponse(
                [pb_utils.Tensor(k, v) for k, v in tensors.items() if not job.wanted or k in job.wanted])
        job.done = final
        if response is None:
            job.sender.send(flags=FINAL)
        else:
            job.sender.send(response, flags=FINAL if final else 0)

    @staticmethod
    def _send_error(sender, message: str) -> None:
        sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)

    async def _stop(self, triton_id: str, sender) -> None:
        """A `stop` request: abort the requests in flight under its id (they end with their tokens)."""
        if not triton_id:
            return self._send_error(sender, "a stop request needs the request id of the requests to stop")
        for job in [j for j in self.jobs.values() if j.triton_id == triton_id]:
            for rid in job.engine_ids:
                await asyncio.get_running_loop().run_in_executor(None, self.llm.abort, rid)
        sender.send(pb_utils.InferenceResponse(), flags=FINAL)  # an empty answer, as TensorRT-LLM's

    async def _watch(self) -> None:
        while self.running:
            await asyncio.sleep(self.cancel_period)
            for job in list(self.jobs.values()):
                if not job.done and job.sender.is_cancelled():
                    self._cancel(job)

    def _cancel(self, job: Job) -> None:
        for task, tracker in zip(job.tasks, job.trackers):
            if not task.done():
                task.cancel()  # closes the row's stream: AsyncLLM aborts the request and frees its blocks
                if tracker.last is not None:
                    self._count(tracker.last)
        job.done = True
        try:
            job.sender.send(flags=FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; Triton may refuse the last flag
            pass

    async def _cancel_all(self) -> None:
        self.watcher.cancel()
        for job in list(self.jobs.values()):
            self._cancel(job)
