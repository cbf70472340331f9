"""A real `tritonserver` started by `kiln triton-serve` on free loopback ports, and the clients the
Triton tests drive it with (HTTP generate_stream, `tritonclient.grpc` streams)."""
import json
import os
import queue
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient

from kiln.utils import free_ports


def free_port() -> int:
    return free_ports(1)[0]


def wait_for(predicate, timeout: float = 60, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Triton:
    """`kiln triton-serve` on free loopback ports; activated: as from a shell that sourced this
    virtualenv's bin/activate (its bin first on PATH), as users run it."""

    def __init__(self, repo: Path, log: Path, activated: bool = True):
        self.http, self.grpc, self.metrics_port = free_ports(3)
        self.url = f"http://127.0.0.1:{self.http}"
        self.log = log
        bin_dir = Path(sys.executable).parent
        env = dict(os.environ, OMP_NUM_THREADS="1")
        if activated and sys.prefix != sys.base_prefix:
            env.update(VIRTUAL_ENV=sys.prefix, PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]))
        self.proc = subprocess.Popen(
            [str(bin_dir / "kiln"), "triton-serve", "--model_repo", str(repo), "--address", "127.0.0.1", "--http-port",
             str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(self.metrics_port)],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 600
        while "tritonserver ready" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kiln triton-serve did not become ready:\n{log.read_text()[-5000:]}")
            time.sleep(0.2)

    def metrics(self) -> dict[str, float]:
        """Series by name and labels, without the model/version labels every series carries."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                name = re.sub(r'(model|version)="[^"]*",?', "", name).replace(",}", "}").replace("{}", "")
                out[name] = out.get(name, 0.0) + float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ready(server: Triton) -> bool:
    try:
        return httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
    except httpx.TransportError:  # draining, Triton takes no new connections
        return False


def kv(m: dict, kind: str) -> float:
    return m[f'nv_trt_llm_kv_cache_block_metrics{{kv_cache_block_type="{kind}"}}']


def idle(server: Triton) -> dict:
    """Metrics once the engine has nothing in flight and every KV block is free again."""
    def check():
        m = server.metrics()
        return m if m['nv_trt_llm_request_metrics{request_type="active"}'] == 0 and kv(m, "free") == kv(m, "max") \
            else None
    return wait_for(check, what="every request done and every KV block free")


def sse(client: httpx.Client, model: str, body: dict) -> list[dict]:
    events = []
    with client.stream("POST", f"/v2/models/{model}/generate_stream", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return events


def grpc_inputs(**arrays) -> list:
    out = []
    for name, value in arrays.items():
        value = np.asarray(value)
        dtype = {np.dtype(bool): "BOOL", np.dtype(np.int32): "INT32", np.dtype(np.float32): "FP32",
                 np.dtype(np.float16): "FP16", np.dtype(np.uint64): "UINT64", np.dtype(object): "BYTES"}[value.dtype]
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        out.append(t)
    return out


def engine_inputs(ids: list[int], max_tokens: int, **extra) -> list:
    def dtype(v):
        return bool if isinstance(v, bool) else np.float32 if isinstance(v, float) else np.int32

    scalars = {k: np.array([[v]], dtype=dtype(v)) for k, v in extra.items()}
    return grpc_inputs(input_ids=np.array([ids], np.int32), input_lengths=np.array([[len(ids)]], np.int32),
                       request_output_len=np.array([[max_tokens]], np.int32), **scalars)


class Stream:
    """A tritonclient.grpc stream collecting responses (or errors) in a queue."""

    def __init__(self, server: Triton):
        self.client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc}")
        self.results = queue.Queue()
        self.client.start_stream(callback=partial(lambda q, result, error: q.put(error or result), self.results))

    def get(self, timeout: float = 120):
        item = self.results.get(timeout=timeout)
        if isinstance(item, Exception):
            raise item
        return item

    def send(self, model: str, inputs: list, **kw):
        self.client.async_stream_infer(model, inputs, enable_empty_final_response=True, **kw)

    def responses(self) -> list:
        """One request's responses, up to its final (empty) one."""
        out = []
        while True:
            result = self.get()
            response = result.get_response()
            if response.outputs:
                out.append(result)
            if response.parameters["triton_final_response"].bool_param:
                return out

    def call(self, model: str, inputs: list, outputs: list[str] | None = None):
        """A request's only response (decoupled models answer over streams only)."""
        self.send(model, inputs, outputs=[grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None)
        (result,) = self.responses()
        return result

    def close(self, cancel: bool = False):
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()
