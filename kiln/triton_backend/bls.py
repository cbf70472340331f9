"""The `tensorrt_llm_bls` model: the ensemble's interface through business-logic scripting. Each
request runs in a thread of its own: preprocessing, then tensorrt_llm (streaming through), then
postprocessing on each of its responses, all as BLS requests.

A client that cancels (a closed connection, a cancelled gRPC stream) is seen by a watcher thread,
which sends tensorrt_llm a `stop` request for the BLS request's id: the engine aborts it."""
import itertools
import json
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from kiln.triton_backend.engine_io import REFUSED
from kiln.triton_backend.interface import (PASSED_THROUGH, PREPROCESSED, TO_ENGINE, TO_POSTPROCESSING,
                                          TO_PREPROCESSING)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
WATCH_PERIOD = 0.1  # seconds between looks for cancelled requests


class BLSError(Exception):
    pass


def _call(model: str, inputs: dict, outputs: list[str], decoupled: bool = False, request_id: str = ""):
    request = pb_utils.InferenceRequest(model_name=model, inputs=[pb_utils.Tensor(k, v) for k, v in inputs.items()],
                                        requested_output_names=outputs, request_id=request_id)
    return request.exec(decoupled=decoupled)


def _tensors(response) -> dict:
    if response.has_error():
        raise BLSError(response.error().message())
    return {t.name(): t.as_numpy() for t in response.output_tensors()}


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.in_flight: dict[str, object] = {}  # tensorrt_llm request id -> the client's response sender
        self.lock = threading.Lock()
        self.ids = itertools.count()
        self.running = True
        self.watcher = threading.Thread(target=self._watch, name="kiln-bls-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            args = (request.request_id(), request.get_response_sender(),
                    {t.name(): t.as_numpy() for t in request.inputs()})
            threading.Thread(target=self._serve, args=args, name="kiln-bls", daemon=True).start()
        return None

    def finalize(self):
        self.running = False
        self.watcher.join(timeout=10)

    def _serve(self, request_id: str, sender, t: dict) -> None:
        engine_id = f"bls-{next(self.ids)}-{request_id}"

        def finish(response=None):
            with self.lock:  # first: asking a finished request whether it is cancelled crashes Triton 2.51
                self.in_flight.pop(engine_id, None)
            if response is None:
                sender.send(flags=FINAL)
            else:
                sender.send(response, flags=FINAL)

        try:
            refused = [name for name in t if name in REFUSED]
            if refused:
                raise BLSError(f"input {refused[0]}: {REFUSED[refused[0]]}; send the request without it")
            text_inputs = {TO_PREPROCESSING[k]: v for k, v in t.items() if k in TO_PREPROCESSING}
            pre = _tensors(_call("preprocessing", text_inputs, list(PREPROCESSED)))
            inputs = {PREPROCESSED[k]: v for k, v in pre.items()}
            inputs.update({TO_ENGINE[k]: v for k, v in t.items() if k in TO_ENGINE})
            with self.lock:
                self.in_flight[engine_id] = sender
            responses = _call("tensorrt_llm", inputs, list(TO_POSTPROCESSING) + PASSED_THROUGH, self.decoupled,
                              engine_id)
            for response in (responses if self.decoupled else [responses]):
                out = _tensors(response)
                if "output_ids" not in out:  # the engine's closing response, without data
                    continue
                text = _tensors(_call("postprocessing", {TO_POSTPROCESSING[k]: out[k] for k in TO_POSTPROCESSING},
                                      ["OUTPUT"]))["OUTPUT"]
                tensors = [pb_utils.Tensor("text_output", text)]
                tensors += [pb_utils.Tensor(k, out[k]) for k in PASSED_THROUGH if k in out]
                if not self.decoupled:
                    return finish(pb_utils.InferenceResponse(tensors))
                sender.send(pb_utils.InferenceResponse(tensors))
            finish()
        except Exception as e:  # noqa: BLE001 - every failure is the client's error response
            message = str(e) if isinstance(e, BLSError) else f"{type(e).__name__}: {e}"
            try:
                finish(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
            except Exception:  # noqa: BLE001 - the client is gone
                pass

    def _watch(self) -> None:
        stopped = set()
        while self.running:
            time.sleep(WATCH_PERIOD)
            with self.lock:
                cancelled = [rid for rid, s in self.in_flight.items() if rid not in stopped and s.is_cancelled()]
            for rid in cancelled:
                stopped.add(rid)
                self._stop(rid)
            with self.lock:
                stopped &= set(self.in_flight)

    def _stop(self, engine_id: str) -> None:
        inputs = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
                  "request_output_len": np.zeros((1, 1), np.int32), "stop": np.ones((1, 1), bool)}
        try:
            responses = _call("tensorrt_llm", inputs, [], self.decoupled, engine_id)
            for _ in responses if self.decoupled else [responses]:
                pass
        except Exception as e:  # noqa: BLE001
            pb_utils.Logger.log_warn(f"tensorrt_llm_bls: could not stop {engine_id}: {e}")
