"""A loaded engine's weights on 2 MiB pages, and in memory once.

A decode step reads every weight once, at the memory's speed; on 4 KiB pages it also takes a TLB
miss, and a page walk (two-dimensional in a virtual machine), for every 4 KiB of them. AOTInductor's
loader copies a package's weights out of its shared library into one malloc'd blob, which Linux's
transparent huge pages, in their common `madvise` mode, leave on 4 KiB pages; and the library's own
copy stays mapped after the copy, counted in the process's RSS a second time.

`loading()` wraps a load. The anonymous memory the load made of about the weights' size (the blob)
is moved onto huge pages (onto_huge_pages), and the load's read-only mappings of the package's files
that hold no private page (the library's copy of the weights) are dropped (MADV_DONTNEED: the kernel
reads them back from the file if anything touches them again), and their page cache with them.
kiln_cpp's CPU allocator asks for huge pages for the large tensors it makes (the KV pool, eager
engines' weights).

Best effort: without /proc/self/maps, or on a kernel without THP, memory stays as it was.
KILN_HUGE_PAGES=0 leaves it so everywhere.
"""
import contextlib
import ctypes
import logging
import os
from pathlib import Path
from typing import NamedTuple

MADV_DONTNEED, MADV_HUGEPAGE = 4, 14
PROT_READ, PROT_WRITE, MAP_PRIVATE, MAP_ANONYMOUS, MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2, 2, 0x20, 1, 2
MAP_FAILED = 2**64 - 1
HUGE_PAGE = 2 << 20
SMALLEST = 2 * HUGE_PAGE  # mappings smaller than two huge pages are left alone
CHUNK = 64 << 20

log = logging.getLogger("kiln")


def enabled() -> bool:
    value = os.environ.get("KILN_HUGE_PAGES", "1")
    if value not in ("0", "1"):
        raise ValueError(f"KILN_HUGE_PAGES must be '0' or '1', got {value!r}")
    return value == "1"


class Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    offset: int
    path: str

    @property
    def size(self) -> int:
        return self.end - self.start


def mappings() -> list[Mapping]:
    """The process's memory mappings ([] where /proc/self/maps is missing)."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        out.append(Mapping(start, end, fields[1], int(fields[2], 16), fields[5] if len(fields) > 5 else ""))
    return out


def private_bytes() -> dict[int, int]:
    """Each mapping's start -> its bytes in private (anonymous or copied-on-write) pages."""
    out, start = {}, None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    start = int(head.split("-")[0], 16)
                elif head == "Anonymous:":
                    out[start] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


_libc = None


def _load_libc() -> None:
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mremap.restype = ctypes.c_void_p
        libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        _libc = libc


def madvise(start: int, size: int, advice: int) -> bool:
    _load_libc()
    return _libc.madvise(start, size, advice) == 0


def thp_available() -> bool:
    """Whether the kernel hands out transparent huge pages to mappings that ask (madvise or always)."""
    try:
        return "[never]" not in Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False


def onto_huge_pages(m: Mapping) -> int:
    """Moves the whole 2 MiB pages of m, an anonymous mapping no other thread touches meanwhile, onto
    huge pages: each part is copied into a fresh mapping that faults them in, which mremap then moves
    (huge pages and all) over the original, freeing its 4 KiB pages. Parts of CHUNK bytes bound the
    memory the move takes beside the weights. MADV_COLLAPSE does it in place, but only from Linux 6.1,
    and it was no faster: 0.08-0.69 s for the Qwen3-MoE-shaped benchmark's 214 MiB on a 2-vCPU KVM
    guest, against 0.07-0.66 s for the copy (huge pages the guest never touched are slow to fault in).
    Returns the bytes moved."""
    _load_libc()
    moved = 0
    start = -(-m.start // HUGE_PAGE) * HUGE_PAGE
    for at in range(start, m.end // HUGE_PAGE * HUGE_PAGE, CHUNK):
        size = min(CHUNK, m.end // HUGE_PAGE * HUGE_PAGE - at)
        raw = _libc.mmap(None, size + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
        if raw in (None, MAP_FAILED):
            break
        new = -(-raw // HUGE_PAGE) * HUGE_PAGE
        for lo, hi in ((raw, new), (new + size, raw + size + HUGE_PAGE)):  # the alignment's slack
            if hi > lo:
                _libc.munmap(lo, hi - lo)
        if not madvise(new, size, MADV_HUGEPAGE):
            _libc.munmap(new, size)
            break
        ctypes.memmove(new, at, size)
        if _libc.mremap(new, size, size, MREMAP_MAYMOVE | MREMAP_FIXED, at) != at:
            _libc.munmap(new, size)
            break
        moved += size
    return moved


def release(m: Mapping) -> None:
    """Drops m, a read-only file mapping with no private page, and the file's pages it held."""
    if not madvise(m.start, m.size, MADV_DONTNEED):
        return
    with contextlib.suppress(OSError):
        fd = os.open(m.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, m.offset, m.size, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def fresh(m: Mapping, before: set[Mapping]) -> list[Mapping]:
    """The parts of m that no mapping in before covered (a new mapping may have merged with an old one)."""
    out, at = [], m.start
    for old in sorted(o for o in before if o.start < m.end and o.end > m.start):
        if old.start > at:
            out.append(m._replace(start=at, end=old.start))
        at = max(at, old.end)
    if at < m.end:
        out.append(m._replace(start=at))
    return out


@contextlib.contextmanager
def loading(package: Path):
    """Wraps the load of the package at `package` (a file, or the folder holding its files)."""
    if not enabled() or not hasattr(os, "posix_fadvise"):
        yield
        return
    before = set(mappings())
    yield
    new = [m for m in mappings() if m not in before]
    root = str(Path(package).resolve())
    files = [m for m in new if m.perms.startswith("r--") and m.size >= SMALLEST
             and (m.path == root or m.path.startswith(root + os.sep))]
    weights = sum(m.size for m in files)  # the library's read-only data: its weights, and little else
    # The copy the loader made of them: new anonymous memory of about their size. Nothing else is
    # moved: another thread's new mapping (its stack, a buffer) could be written to while it is copied.
    blobs = [part for m in new if m.perms == "rw-p" and not m.path for part in fresh(m, before)
             if 0.9 * weights <= part.size <= 1.1 * weights + HUGE_PAGE and part.size >= SMALLEST]
    moved = onto_huge_pages(max(blobs, key=lambda m: m.size)) if blobs and thp_available() else 0
    private = private_bytes() if files else {}
    dropped = [m for m in files if private.get(m.start) == 0]
    for m in dropped:
        release(m)
    log.debug("engine load: %d MiB of weights moved onto huge pages, %d MiB of the package's own copy dropped",
              moved >> 20, sum(m.size for m in dropped) >> 20)
