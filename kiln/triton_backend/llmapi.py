"""The `llmapi` layout's one model, `tensorrt_llm`: text in, text out, in one process (no
preprocessing or postprocessing hops). One in-process AsyncLLM, configured by the model.yaml beside
this model's model.py, serves every request; an asyncio loop in a thread of its own runs each one and
answers through its response sender, as the inflight_batcher_llm layout's tensorrt_llm does.

Cancellation, as TensorRT-LLM's llmapi model: a request Triton has cancelled (a stopped gRPC stream,
a closed HTTP connection) or one stopped by a `stop` request under its request id is aborted in the
engine and answered with a CANCELLED error."""
import asyncio
import json
import os
from dataclasses import dataclass
from pathlib import Path

import triton_python_backend_utils as pb_utils

from kiln.config import EngineConfig
from kiln.triton_backend.engine_host import EngineHost
from kiln.triton_backend.engine_io import RequestError
from kiln.triton_backend.llmapi_io import ModelYamlError, parse_request, read_model_yaml, response_tensors
from kiln.triton_backend.metrics import EngineMetrics

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
STATS_PERIOD = 0.1  # seconds between metrics updates (the layout has no parameter for it)


def model_yaml(model_dir) -> Path:
    """TensorRT-LLM's lookup: $LLM_CONFIG_PATH, else model.yaml in the version directory."""
    return Path(os.environ.get("LLM_CONFIG_PATH") or Path(model_dir) / "model.yaml")


@dataclass
class Job:
    triton_id: str
    sender: object
    engine_id: str
    task: asyncio.Task | None = None
    done: bool = False


class TritonPythonModel(EngineHost):
    def initialize(self, args):
        from kiln.runtime.frontend.async_llm import AsyncLLM  # here: importing this module stays cheap

        config = json.loads(args["model_config"])
        path = model_yaml(Path(args["model_repository"]) / args["model_version"])
        try:
            cfg = read_model_yaml(path)
        except ModelYamlError as e:
            raise pb_utils.TritonModelException(f"tensorrt_llm: {e}") from None
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        mismatch = {k: (v, config.get(k, 0) if k == "max_batch_size" else self.decoupled)
                    for k, v in (("max_batch_size", cfg.max_batch_size), ("decoupled", cfg.decoupled))
                    if v != (config.get(k, 0) if k == "max_batch_size" else self.decoupled)}
        if mismatch:
            raise pb_utils.TritonModelException(
                f"tensorrt_llm: {path} and config.pbtxt disagree on " + ", ".join(
                    f"{k} ({a} in triton_config, {b} in config.pbtxt)" for k, (a, b) in mismatch.items())
                + ": rewrite the repository with `kiln triton-repo --layout llmapi`")
        self.cancel_period = cfg.cancellation_check_period_ms / 1000
        engine = EngineConfig.load(cfg.engine_dir)
        self.tokens_per_block = engine.build_config.tokens_per_block
        self.llm = AsyncLLM(cfg.engine_dir, tokenizer=cfg.tokenizer, **cfg.engine_args)
        self.start(self.llm, EngineMetrics(args["model_name"], args["model_version"],
                                           engine.build_config.max_batch_size, self.tokens_per_block),
                   STATS_PERIOD, "kiln-llmapi")

    def execute(self, requests):
        for request in requests:
            tensors = {t.name(): t.as_numpy() for t in request.inputs()}
            asyncio.run_coroutine_threadsafe(
                self._serve(request.request_id(), request.get_response_sender(), tensors), self.loop)
        return None

    async def _serve(self, triton_id: str, sender, tensors: dict) -> None:
        if tensors.get("stop") is not None and tensors["stop"].reshape(-1)[:1].any():
            return self._stop(triton_id, sender)
        try:
            request = parse_request(tensors, self.decoupled)
        except Exception as e:  # noqa: BLE001 - a RequestError names the input; anything else must still answer
            message = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
            return sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)), flags=FINAL)
        key = next(self.ids)
        job = self.jobs[key] = Job(triton_id, sender, f"llmapi-{key}")
        job.task = asyncio.current_task()
        out = None
        try:
            async for out in self.llm.generate(request.prompt, request.params, job.engine_id):
                if request.streaming or out.finished:
                    self._send(job, pb_utils.InferenceResponse([pb_utils.Tensor(k, v) for k, v in response_tensors(
                        request, out, self.tokens_per_block).items()]), out.finished)
        except asyncio.CancelledError:
            pass
        except Exception as e:  # noqa: BLE001 - the engine refused the request, or died: the client's error
            self._send(job, pb_utils.InferenceResponse(error=pb_utils.TritonError(str(e) or type(e).__name__)), True)
        finally:
            self.jobs.pop(key, None)
            if out is not None:  # cancelled ones too: their tokens were generated
                self._count(out)

    def _send(self, job: Job, response, final: bool) -> None:
        if not job.done:
            job.done = final
            job.sender.send(response, flags=FINAL if final else 0)

    @staticmethod
    def _cancelled_error():
        return pb_utils.InferenceResponse(error=pb_utils.TritonError("Request cancelled by client",
                                                                     pb_utils.TritonError.CANCELLED))

    def _cancelled(self, job: Job) -> None:
        """Abort a request (closing its stream aborts it in the engine) and tell its client."""
        if job.done:
            return
        job.done = True
        if job.task is not None:
            job.task.cancel()
        try:
            job.sender.send(self._cancelled_error(), flags=FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; Triton may refuse the answer
            pass

    def _stop(self, triton_id: str, sender) -> None:
        if not triton_id:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(
                "a stop request needs the request id of the requests to stop")), flags=FINAL)
            return
        for job in [j for j in self.jobs.values() if j.triton_id == triton_id]:
            self._cancelled(job)
        sender.send(self._cancelled_error(), flags=FINAL)

    async def _watch(self) -> None:
        while self.running:
            await asyncio.sleep(self.cancel_period)
            for job in list(self.jobs.values()):
                if not job.done and job.sender.is_cancelled():
                    self._cancelled(job)

    async def _cancel_all(self) -> None:
        self.watcher.cancel()
        for job in list(self.jobs.values()):
            self._cancelled(job)
