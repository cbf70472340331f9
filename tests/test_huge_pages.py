"""Engine weights on 2 MiB pages (kiln/engine/huge_pages.py) and the CPU allocator's large tensors
(kiln/plugins/csrc/cpu_allocator.cpp)."""
import ctypes
import mmap
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from kiln.engine import huge_pages
from kiln.plugins import cpp

pytestmark = pytest.mark.skipif(not huge_pages.mappings(), reason="needs Linux's /proc/self/maps")
MIB = 1 << 20


def smaps_of(address: int) -> dict[str, int]:
    """The smaps fields (kB) of the mapping holding address."""
    fields, inside = {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(v, 16) for v in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside and line.split()[-1] == "kB":
                fields[head.rstrip(":")] = int(line.split()[1])
    return fields


def anonymous(size: int) -> int:
    """A private anonymous mapping, as malloc makes for a large block, filled with a pattern."""
    huge_pages._load_libc()
    address = huge_pages._libc.mmap(None, size, huge_pages.PROT_READ | huge_pages.PROT_WRITE,
                                    huge_pages.MAP_PRIVATE | huge_pages.MAP_ANONYMOUS, -1, 0)
    ctypes.memmove(address, pattern(size), size)
    return address


def pattern(size: int) -> bytes:
    return bytes(range(251)) * (size // 251) + bytes(size % 251)


def test_a_loaded_copy_of_the_weights_moves_onto_huge_pages(tmp_path):
    weights = tmp_path / "engine" / "model.so"
    weights.parent.mkdir()
    weights.write_bytes(pattern(12 * MIB))
    with huge_pages.loading(weights.parent):
        with open(weights, "rb") as f:  # the library's copy, read as the loader reads it
            library = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        assert library[:251] == pattern(251)
        blob = anonymous(12 * MIB + 4096)  # its copy of the weights
    assert ctypes.string_at(blob, 12 * MIB + 4096) == pattern(12 * MIB + 4096)
    if huge_pages.thp_available():
        assert smaps_of(blob + 4 * MIB)["AnonHugePages"] >= 8 * 1024
    library_at = next(m.start for m in huge_pages.mappings() if m.path == str(weights))
    assert smaps_of(library_at)["Rss"] == 0  # dropped; still readable, from the file
    assert library[5 * MIB:5 * MIB + 251] == pattern(12 * MIB)[5 * MIB:5 * MIB + 251]
    library.close()


def test_only_a_copy_of_the_weights_moves(tmp_path):
    with huge_pages.loading(tmp_path):  # no library: any new memory is another thread's
        other = anonymous(8 * MIB)
    assert smaps_of(other).get("AnonHugePages", 0) == 0
    assert ctypes.string_at(other, 8 * MIB) == pattern(8 * MIB)


def test_it_can_be_turned_off(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HUGE_PAGES", "0")
    with huge_pages.loading(tmp_path):
        blob = anonymous(8 * MIB)
    assert smaps_of(blob).get("AnonHugePages", 0) == 0
    monkeypatch.setenv("KILN_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="KILN_HUGE_PAGES must be '0' or '1', got 'yes'"):
        huge_pages.enabled()


def allocator_huge_pages() -> tuple[int, int, bool, int]:
    """AnonHugePages (kB) of a 40 MiB tensor (the system's block) and of a fresh 14 MiB size-class
    block with huge pages on, whether the first read back right, and AnonHugePages of a 40 MiB
    tensor with them off."""
    cpp.load()
    torch.ops.kiln_cpp.use_caching_allocator(True, True)
    t = torch.ones(40 * MIB, dtype=torch.uint8)
    big = smaps_of(t.data_ptr() + 20 * MIB).get("AnonHugePages", 0)
    intact = int(t.sum()) == t.numel()
    del t
    # The cache holds at most 18 blocks of 14 MiB, so the 19th is a fresh one.
    blocks = [torch.empty(14 * MIB, dtype=torch.uint8) for _ in range(19)]
    blocks[-1].fill_(1)
    block = smaps_of(blocks[-1].data_ptr() + 7 * MIB).get("AnonHugePages", 0)
    del blocks
    torch.ops.kiln_cpp.use_caching_allocator(True, False)
    t = torch.ones(40 * MIB, dtype=torch.uint8)
    return big, block, intact, smaps_of(t.data_ptr() + 20 * MIB).get("AnonHugePages", 0)


@pytest.mark.skipif(not huge_pages.thp_available(), reason="the kernel gives no transparent huge pages")
def test_the_allocator_puts_large_tensors_on_huge_pages():
    # In a fresh process: memory that glibc hands out again keeps the advice it was given before,
    # and how much of that a long-running test process holds depends on the tests before.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        big, block, intact, off = pool.submit(allocator_huge_pages).result()
    assert big > 0 and block > 0 and intact
    assert off == 0
