"""How a frontend talks to the engine core: in this thread, or through a pipe to the core's busy loop
in a process (or a thread) of its own.

`InprocClient` runs each call on the spot: `get_outputs()` is one engine step. `BackgroundClient`
starts `run_engine_core` (kiln/runtime/core/core_process.py), which steps whenever it has work, sends
each step's outputs at once and takes the next step while the frontend detokenizes and streams the
last one (vLLM v1's engine core process). Its pipe carries requests and aborts one way, outputs
(with the scheduler's stats) the other. A core process that dies closes its end of the pipe: the frontend's next read raises
`EngineDeadError`, and so does every call after it. A core whose executor lost a rank sends the
EngineDeadError saying which, and stops.
"""
import os
import socket
import subprocess
import sys
import threading

from kiln.runtime.core.core_process import run_engine_core
from kiln.runtime.core.engine_core import EngineCore
from kiln.runtime.messages import EngineCoreOutputs, EngineCoreRequest, EngineDeadError, Pipe
from kiln.utils import child_env


def make_client(engine_dir, engine_core: str, core_args: dict):
    if engine_core == "inproc":
        return InprocClient(engine_dir, **core_args)
    return BackgroundClient(engine_dir, engine_core, **core_args)


class InprocClient:
    def __init__(self, engine_dir, **core_args):
        self.core = EngineCore(engine_dir, **core_args)
        self.info = self.core.info
        self._dead: EngineDeadError | None = None

    def add_request(self, request: EngineCoreRequest) -> None:
        if self._dead is not None:
            raise self._dead
        self.core.add_request(request)

    def abort(self, request_id: str, index: int | None = None) -> None:
        self.core.abort(request_id, index)

    def get_outputs(self) -> EngineCoreOutputs:
        if self._dead is not None:
            raise self._dead
        try:
            return self.core.step()
        except EngineDeadError as e:  # a rank died: the engine is gone for good
            self._dead = e
            raise

    def shutdown(self) -> None:
        self.core.shutdown()


class BackgroundClient:
    def __init__(self, engine_dir, mode: str = "process", **core_args):
        if mode not in ("thread", "process"):
            raise ValueError(f"engine core mode {mode!r}: expected 'thread' or 'process'")
        ours, theirs = socket.socketpair()
        self.conn = Pipe(ours.detach())
        self._send_lock = threading.Lock()
        self._dead: EngineDeadError | None = None
        if mode == "process":
            # A fresh interpreter running this module (not multiprocessing's spawn, which re-imports
            # the caller's __main__ and so needs an `if __name__ == "__main__"` guard in every script).
            env = child_env()
            self.worker = subprocess.Popen([sys.executable, "-m", "kiln.runtime.core.core_process", str(theirs.fileno())],
                                           pass_fds=[theirs.fileno()], env=env)
            theirs.close()  # the core's end lives in its process only: its death ends the pipe
        else:
            self.worker = threading.Thread(target=run_engine_core, args=(Pipe(theirs.detach()),),
                                           name="kiln-engine-core", daemon=True)
            self.worker.start()
        self.conn.send((str(engine_dir), core_args))
        self.info = self._ready()

    def _ready(self):
        try:
            kind, payload = self.conn.recv()
        except (EOFError, OSError):
            self._join(10)
            raise EngineDeadError(f"the engine core exited while loading (exit code "
                                  f"{getattr(self.worker, 'returncode', None)})") from None
        if kind == "failed":
            self._join(10)
            raise payload
        return payload

    @property
    def pid(self) -> int:
        return getattr(self.worker, "pid", None) or os.getpid()

    def _join(self, timeout: float) -> None:
        if isinstance(self.worker, subprocess.Popen):
            try:
                self.worker.wait(timeout)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        else:
            self.worker.join(timeout)

    def _send(self, message) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError):
            raise self._died() from None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(("add", request))

    def abort(self, request_id: str, index: int | None = None) -> None:
        try:
            self._send(("abort", request_id, index))
        except EngineDeadError:
            pass  # nothing left to abort

    def get_outputs(self) -> EngineCoreOutputs:
        """The next step's outputs (or stats after aborts), waiting for them. One reader at a time."""
        if self._dead is not None:
            raise self._dead
        try:
            outputs = self.conn.recv()
        except (EOFError, OSError):
            raise self._died() from None
        if isinstance(outputs, EngineDeadError):
            self._dead = outputs
            raise outputs
        return outputs

    def _died(self) -> EngineDeadError:
        if self._dead is None:
            code = None
            if isinstance(self.worker, subprocess.Popen):
                try:
                    code = self.worker.wait(1)  # its pipe closed as it exited: reap it for the exit code
                except subprocess.TimeoutExpired:
                    pass
            self._dead = EngineDeadError(f"the engine core (pid {self.pid}) died"
                                         + (f" with exit code {code}" if code is not None else ""))
        return self._dead

    def shutdown(self, timeout: float = 10) -> None:
        try:
            self._send(("shutdown",))
        except EngineDeadError:
            pass
        self._join(timeout)
        self.conn.close()
