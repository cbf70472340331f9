"""The executor of a multi-rank engine on one machine: one worker process per rank.

The engine core's process schedules and sends each step once: the encoded inputs go into a
shared-memory ring that every worker maps, and one byte down each worker's wake pipe says a message
is there. The rank that returns the logits (the last stage's tp rank 0) writes them into a second
ring and says so on its reply pipe. With pipeline parallelism up to pp_size steps are in flight
(`submit` / `collect`, the engine core's batch queue), so that each stage works on a different one.
The ranks' collectives and stage sends run among the workers (distributed.py),
rendezvousing through a TCP store this process hosts.

A worker that dies closes its reply pipe: the executor notices while waiting for a step (and the
engine core's idle loop waits on `sentinels` too), kills the other workers and raises a sticky
EngineDeadError naming the rank. The workers end on their own when this process dies: their wake
pipe reads end-of-file, and a rank blocked in a collective with a dead rank gets an error.
"""
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist

from kiln.config import ConfigError, EngineConfig
from kiln.engine.format import warmup_inputs
from kiln.lora.adapter import Adapter
from kiln.runtime.executor.base import Executor
from kiln.runtime.executor.shm_ring import ShmRing, decode
from kiln.runtime.messages import EngineDeadError
from kiln.utils import child_env


class MultiprocExecutor(Executor):
    def __init__(self, engine_dir, kv_cache_free_mem_fraction: float | None = None,
                 max_tokens_in_paged_kv_cache: int | None = None, threads: int = 1, max_loras: int = 4):
        super().__init__()
        self.config = EngineConfig.load(engine_dir)
        p, b = self.config.pretrained_config, self.config.build_config
        world = p.mapping.world_size
        self.result_rank = (p.mapping.pp_size - 1) * p.mapping.tp_size
        # Steps in flight at once: one per pipeline stage. Each ring holds that many messages.
        self.max_concurrent_batches = p.mapping.pp_size
        self.dead: EngineDeadError | None = None
        self._copies: list[tuple[int, int]] = []
        self._loras: list[str] = []  # "slot\tadapter dir" for the next step to load first
        self._sent = 0
        self._collected = 0
        self._pending = 0  # steps submitted and not collected
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=60))
        # A step's inputs: token-sized (sequence_lens too), [Sc, Qmax] (Sc * Qmax <= batch * tokens) and
        # block tables.
        T, B, MB = b.max_num_tokens, b.max_batch_size, b.max_blocks_per_seq
        self.steps = ShmRing.create("steps", max(2, self.max_concurrent_batches),
                                    8 * (7 * T + B * T + 2 * B * MB + 8 * B) + (64 << 10))
        # Logits of a batch of decodes; more (prompt logprobs) come through the reply pipe.
        self.results = ShmRing.create("logits", self.max_concurrent_batches,
                                      4 * max(B, 16) * p.vocab_size + (16 << 10))
        self.procs: list[subprocess.Popen] = []
        self.wakes: list[int] = []
        self.replies: list[Connection] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.wakes, self.replies, [self.steps, self.results])
        try:
            for rank in range(world):
                self._spawn(rank, dict(
                    engine_dir=str(engine_dir), rank=rank, world_size=world, port=self.store.port,
                    threads=max(1, threads // world), kv_cache_free_mem_fraction=kv_cache_free_mem_fraction,
                    max_tokens_in_paged_kv_cache=max_tokens_in_paged_kv_cache, max_loras=max_loras,
                    steps=str(self.steps.path), steps_size=[self.steps.slots, self.steps.slot_bytes],
                    results=str(self.results.path), results_size=[self.results.slots, self.results.slot_bytes]))
            self.num_blocks = min(self._loaded())
            self.steps.unlink()  # mapped by every worker: nothing is left in /dev/shm, whatever happens
            self.results.unlink()
            self._broadcast("allocate", {"num_blocks": torch.tensor(self.num_blocks)})
            self.execute(warmup_inputs())
        except EngineDeadError as e:
            self.shutdown()
            raise RuntimeError(str(e).replace("the engine died", "the engine failed to start", 1)) from None
        except BaseException:
            self.shutdown()
            raise

    def _spawn(self, rank: int, spec: dict) -> None:
        wake_r, wake_w = os.pipe()
        reply_r, reply_w = os.pipe()
        try:
            proc = subprocess.Popen([sys.executable, "-m", "kiln.runtime.executor.worker", json.dumps(spec),
                                     str(wake_r), str(reply_w)], pass_fds=[wake_r, reply_w], env=child_env())
        finally:
            os.close(wake_r)  # each pipe's other end lives in its worker only: its death ends the pipe
            os.close(reply_w)
        self.procs.append(proc)
        self.wakes.append(wake_w)
        self.replies.append(Connection(reply_r, writable=False))

    def _loaded(self) -> list[int]:
        """Each rank's KV pool size once every rank has loaded; a rank that cannot fails the start."""
        blocks: dict[int, int] = {}
        while len(blocks) < len(self.procs):
            for conn in wait([c for r, c in enumerate(self.replies) if r not in blocks]):
                rank = self.replies.index(conn)
                message = self._recv(rank)
                if message[0] == "failed":
                    kind, text = message[1], message[2]
                    raise (ConfigError if kind == "ConfigError" else RuntimeError)(f"failed to load {text}")
                blocks[rank] = message[1]
        return list(blocks.values())

    def _recv(self, rank: int):
        try:
            return self.replies[rank].recv()
        except (EOFError, OSError):
            raise self._died(rank) from None

    def _died(self, rank: int) -> EngineDeadError:
        try:
            self.procs[rank].wait(2)  # its pipe closed as it exited: reap it for the exit status
        except subprocess.TimeoutExpired:
            pass
        return self._fail()

    def _fail(self, message: str = "") -> EngineDeadError:
        """The engine is dead: named by the ranks that died of a signal or an unexpected exit code
        (the cause; what the others then reported is a consequence), else by what a rank reported."""
        if self.dead is None:
            def status(r, p):
                code = p.returncode
                return f"rank {r} (pid {p.pid}) " + (f"was killed by {signal.Signals(-code).name}" if code < 0
                                                     else f"exited with code {code}")

            # A rank that saw a peer vanish (its pipe or shared memory gone) can report it before the
            # peer can be reaped: the kernel closes a dying process's files before it turns waitable.
            deadline = time.monotonic() + 1.0
            while all(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
                time.sleep(0.01)
            exited = [(r, p) for r, p in enumerate(self.procs) if p.poll() is not None]
            causes = [status(r, p) for r, p in exited if p.returncode not in (0, 1)]
            if not causes:
                causes = [message] if message else [status(r, p) for r, p in exited]
            self.dead = EngineDeadError("the engine died: " + "; ".join(causes))
            _stop(self.procs, self.wakes, self.replies, [], graceful=False)
        return self.dead

    # -- the executor's calls ------------------------------------------------------------------
    @property
    def sentinels(self) -> list:
        """Readable when a worker dies (or reports an error): the engine core waits on them while idle."""
        return [] if self.dead is not None else list(self.replies)

    def check(self) -> None:
        """Raises the EngineDeadError if a worker has died or reported an error."""
        if self.dead is not None:
            raise self.dead
        for rank in range(len(self.procs)):
            if rank == self.result_rank and self._pending:
                continue  # what it sent may be a result: collect() reads it, or the error in its place
            if self.replies[rank].poll():
                message = self._recv(rank)
                raise self._fail(message[2] if message[0] == "error" else f"rank {rank} sent {message[0]!r}")

    def execute(self, inputs: dict) -> torch.Tensor:
        self.submit(inputs)
        return self.collect()

    def submit(self, inputs: dict) -> None:
        """Send a step without waiting for it: at most max_concurrent_batches uncollected."""
        self.check()
        if self._copies:
            inputs = {**inputs, "copy_blocks": torch.tensor(self._copies, dtype=torch.int64)}
            self._copies = []
        if self._loras:
            loads = "\n".join(self._loras).encode()
            inputs = {**inputs, "set_lora": torch.tensor(list(loads), dtype=torch.uint8)}
            self._loras = []
        self._broadcast("step", inputs)
        self._pending += 1

    def collect(self) -> torch.Tensor:
        """The logits of the oldest step submitted and not yet collected."""
        logits = self._result()
        self._pending -= 1
        return logits

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._copies.extend(pairs)

    def set_lora(self, slot: int, adapter: Adapter) -> None:
        """Every rank reads the adapter dir and loads its share into the slot before the next step,
        which carries the request (the ring holds as many messages as steps in flight, no more)."""
        self._loras.append(f"{slot}\t{adapter.path}")  # done by every rank before the next step, which first reads them

    def _broadcast(self, kind: str, tensors: dict) -> None:
        if not self.steps.write(self._sent, kind, tensors):
            raise RuntimeError(f"a step's inputs do not fit the ring's {self.steps.slot_bytes}-byte slot")
        self._sent += 1
        for rank, fd in enumerate(self.wakes):
            try:
                os.write(fd, b"\0")
            except OSError:
                raise self._died(rank) from None

    def _result(self) -> torch.Tensor:
        while True:
            for conn in wait(self.replies):
                rank = self.replies.index(conn)
                message = self._recv(rank)
                if message[0] == "result" and rank == self.result_rank:
                    n, self._collected = self._collected, self._collected + 1
                    out = (self.results.read(n) if message[1] is None else decode(message[1]))[1]
                    # the captured states outlive the ring slot they arrived in (the draft reads them later)
                    return (out["logits"], out["captured"].clone()) if "captured" in out else out["logits"]
                raise self._fail(message[2] if message[0] == "error" else f"rank {rank} sent {message[0]!r}")

    def shutdown(self) -> None:
        self._finalizer()


def _stop(procs, wakes, replies, rings, graceful: bool = True) -> None:
    """Stops the workers and reaps them: closing a wake pipe ends its worker's loop (graceful),
    else SIGTERM; SIGKILL for one that does not go."""
    for fd in wakes:
        try:
            os.close(fd)
        except OSError:
            pass
    wakes.clear()
    if not graceful:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
    for proc in procs:
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for conn in replies:
        conn.close()
    for ring in rings:
        ring.close()
