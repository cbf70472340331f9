"""Messages of named tensors, and a ring of them in shared memory that several processes read.

A message is a kind ("step", "allocate", "stop", ...) and a dict of CPU tensors, encoded as a small
JSON header and the tensors' bytes: nothing is unpickled, so a message from another machine
(torchrun.py) is data, never code.

`ShmRing` is a file under /dev/shm that the writer maps and each reader maps too: the writer puts
message n into slot n % slots and wakes the readers through their pipes (the pipe write orders the
slot's bytes before the reader's read); each reader copies the tensors out. The caller keeps at most
`slots` messages unread, which the executors do by never having more steps than that uncollected.
"""
import json
import mmap
import os
import struct
import uuid
from pathlib import Path

import psutil
import torch

SHM = Path("/dev/shm")
_LEN = struct.Struct("<Q")


def _header(kind: str, tensors: dict) -> tuple[bytes, int]:
    """The message's header (its length first) and the size of the tensor bytes after it."""
    entries, size = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), size, nbytes])
        size += nbytes
    head = json.dumps({"kind": kind, "tensors": entries}).encode()
    return _LEN.pack(len(head)) + head, size


def _put(buf, start: int, tensors: dict) -> None:
    """Each tensor's bytes, in order, into the writable buffer from `start`: one copy, no bytes object."""
    for t in tensors.values():
        nbytes = t.numel() * t.element_size()
        if nbytes:
            dst = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=start)
            dst.copy_(t.contiguous().reshape(-1).view(torch.uint8))
            start += nbytes


def encode(kind: str, tensors: dict | None = None) -> bytearray:
    head, size = _header(kind, tensors or {})
    out = bytearray(len(head) + size)
    out[:len(head)] = head
    _put(out, len(head), tensors or {})
    return out


def decode(buf) -> tuple[str, dict]:
    """(kind, tensors) of an encoded message; the tensors are copies, not views of buf."""
    buf = memoryview(buf)
    (n,) = _LEN.unpack_from(buf, 0)
    head = json.loads(bytes(buf[_LEN.size:_LEN.size + n]))
    base = _LEN.size + n
    tensors = {}
    for name, dtype, shape, offset, size in head["tensors"]:
        dt = getattr(torch, dtype)
        if size:
            raw = torch.frombuffer(buf, dtype=torch.uint8, count=size, offset=base + offset)
            tensors[name] = raw.clone().view(dt).view(shape)
        else:
            tensors[name] = torch.empty(shape, dtype=dt)
    return head["kind"], tensors


class ShmRing:
    """slots x slot_bytes of shared memory. create() makes the file, attach(path) maps it in another
    process; unlink() removes the name once every process has mapped it (the mappings stay)."""

    def __init__(self, path: Path, slots: int, slot_bytes: int, create: bool):
        self.path, self.slots, self.slot_bytes = Path(path), slots, slot_bytes
        size = slots * slot_bytes
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)

    @classmethod
    def create(cls, what: str, slots: int, slot_bytes: int) -> "ShmRing":
        sweep()
        return cls(SHM / f"kiln-{os.getpid()}-{what}-{uuid.uuid4().hex[:8]}", slots, slot_bytes, create=True)

    @classmethod
    def attach(cls, path: str, slots: int, slot_bytes: int) -> "ShmRing":
        return cls(Path(path), slots, slot_bytes, create=False)

    def write(self, n: int, kind: str, tensors: dict | None = None) -> bool:
        """Message n into its slot, the tensors copied straight in; False (nothing written) when it
        does not fit one."""
        head, size = _header(kind, tensors or {})
        if _LEN.size + len(head) + size > self.slot_bytes:
            return False
        start = (n % self.slots) * self.slot_bytes
        self.map[start:start + _LEN.size + len(head)] = _LEN.pack(len(head) + size) + head
        _put(self.map, start + _LEN.size + len(head), tensors or {})
        return True

    def read(self, n: int) -> tuple[str, dict]:
        start = (n % self.slots) * self.slot_bytes
        (size,) = _LEN.unpack_from(self.map, start)
        return decode(memoryview(self.map)[start + _LEN.size:start + _LEN.size + size])

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)

    def close(self) -> None:
        self.unlink()
        try:
            self.map.close()
        except BufferError:  # a tensor still views it; the mapping goes with the process
            pass


def sweep() -> None:
    """Removes rings whose maker died before every reader had mapped them (and so before unlink)."""
    try:
        names = [p for p in SHM.glob("kiln-*-*") if p.is_file()]
    except OSError:
        return
    for path in names:
        pid = path.name.split("-")[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            path.unlink(missing_ok=True)
