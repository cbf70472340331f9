"""The engine core's own process (or thread): its busy loop and the pipe protocol to the frontend.

Over the pipe come ("add", EngineCoreRequest), ("abort", request_id, index) and ("shutdown",); back
go ("ready", EngineInfo) or ("failed", error) once, then an EngineCoreOutputs per step, or the
EngineDeadError of an executor that lost a rank (kiln/runtime/messages.py).
"""
import pickle
import signal
import sys
from multiprocessing.connection import Connection, wait

from kiln.runtime.core.engine_core import EngineCore
from kiln.runtime.messages import EngineCoreOutputs, EngineDeadError, Pipe


def run_engine_core(conn: Connection) -> None:
    """The core's busy loop: take what arrived, step while there is work, send every step's outputs.
    Its pipe carries requests and aborts in, outputs (with the scheduler's stats) out; a core whose
    executor lost a rank sends the EngineDeadError saying which, and stops."""
    try:
        engine_dir, core_args = conn.recv()
        core = EngineCore(engine_dir, **core_args)
    except BaseException as e:  # noqa: BLE001 - the frontend raises it
        conn.send(("failed", _picklable(e)))
        conn.close()
        return
    conn.send(("ready", core.info))
    try:
        while True:
            if not core.has_unfinished_requests():
                # Idle: wait for work, or for a rank of the engine to die.
                if conn not in wait([conn, *core.executor.sentinels]):
                    core.executor.check()
                    continue
                if not _handle(core, conn.recv()):
                    return
            while conn.poll():
                if not _handle(core, conn.recv()):
                    return
            conn.send(_step(core) if core.has_unfinished_requests() else EngineCoreOutputs([], core.stats()))
    except EngineDeadError as e:
        try:
            conn.send(e)
        except (EOFError, OSError):
            pass
    except (EOFError, OSError):  # the frontend is gone: so is the core
        return
    finally:
        core.shutdown()
        conn.close()


def _handle(core: EngineCore, message) -> bool:
    kind = message[0]
    if kind == "add":
        core.add_request(message[1])
    elif kind == "abort":
        core.abort(message[1], message[2])
    elif kind == "shutdown":
        return False
    return True


def _step(core: EngineCore) -> EngineCoreOutputs:
    try:
        return core.step()
    except EngineDeadError:
        raise
    except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
        ids = list(core.requests)
        for rid in ids:
            core.abort(rid)
        return EngineCoreOutputs([], core.stats(), [(ids, f"{type(e).__name__}: {e}")])


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.dumps(e)
        return e
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(e).__name__}: {e}")


if __name__ == "__main__":  # the core process: python -m kiln.runtime.core.core_process FD
    # Ctrl+C reaches the whole process group; the frontend handles it (a server drains first, then
    # shuts the core down) and the core ends when its pipe does.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_engine_core(Pipe(int(sys.argv[1])))
