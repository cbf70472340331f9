"""kiln_cpp's caching CPU allocator (kiln/plugins/csrc/cpu_allocator.cpp), which engine loading
installs for the process's CPU tensors."""
import pytest
import torch

from kiln.engine import loader
from kiln.plugins import cpp


@pytest.fixture
def caching():
    cpp.load()
    was = torch.ops.kiln_cpp.use_caching_allocator(True)
    yield
    torch.ops.kiln_cpp.use_caching_allocator(was)


@pytest.mark.parametrize("nbytes", [1, 64, 1000, 1025, 3 << 20, 32 << 20])
def test_freed_blocks_are_handed_out_again(caching, nbytes):
    t = torch.empty(nbytes, dtype=torch.uint8)
    ptr = t.data_ptr()
    assert ptr % 64 == 0
    t.fill_(7)
    del t
    again = torch.empty(nbytes, dtype=torch.uint8)
    assert again.data_ptr() == ptr
    again.fill_(1)
    assert int(again.sum()) == again.numel()
    del again
    assert torch.empty(nbytes - 1, dtype=torch.bfloat16).data_ptr() != ptr  # a larger class

def test_large_and_empty_tensors_go_to_the_system(caching):
    big = torch.ones(40 << 20, dtype=torch.uint8)  # over 32 MiB: not cached
    ptr = big.data_ptr()
    del big
    small = torch.empty(1 << 20, dtype=torch.uint8)
    assert small.data_ptr() != ptr
    assert torch.empty(0).numel() == 0


def test_tensors_outlive_a_change_of_allocator():
    cpp.load()
    was = torch.ops.kiln_cpp.use_caching_allocator(True)
    try:
        cached = torch.arange(1000.0)
        assert torch.ops.kiln_cpp.use_caching_allocator(False)  # it was installed
        system = torch.arange(1000.0)
        assert not torch.ops.kiln_cpp.use_caching_allocator(True)
        assert torch.equal(cached, system)
        del cached, system  # each freed by the allocator that made it
        x = torch.randn(64, 64)
        torch.testing.assert_close(x @ torch.eye(64), x)
    finally:
        torch.ops.kiln_cpp.use_caching_allocator(was)


def test_engine_loading_picks_it_by_environment(monkeypatch):
    cpp.load()
    was = torch.ops.kiln_cpp.use_caching_allocator(False)
    try:
        monkeypatch.setenv("KILN_CPU_ALLOCATOR", "system")
        loader.use_caching_allocator()
        assert not torch.ops.kiln_cpp.use_caching_allocator(False)
        monkeypatch.delenv("KILN_CPU_ALLOCATOR")
        loader.use_caching_allocator()
        assert torch.ops.kiln_cpp.use_caching_allocator(True)
        monkeypatch.setenv("KILN_CPU_ALLOCATOR", "tcmalloc")
        with pytest.raises(ValueError, match="KILN_CPU_ALLOCATOR must be 'caching' or 'system'"):
            loader.use_caching_allocator()
    finally:
        torch.ops.kiln_cpp.use_caching_allocator(was)
