"""Intra-op threads: --threads, then OMP_NUM_THREADS, then the cores the process may use."""
import os
import subprocess
import sys

import pytest
import torch

from kiln.threads import available_cpus, configure_threads


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_explicit_then_env_then_cores(restore_threads, monkeypatch):
    assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(2)
    assert configure_threads() == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = available_cpus()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert configure_threads() == cores == torch.get_num_threads()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"


def test_bad_thread_counts(restore_threads, monkeypatch):
    with pytest.raises(ValueError, match="threads must be >= 1"):
        configure_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many'"):
        configure_threads()


def test_affinity_bounds_the_default():
    """A process pinned to one core runs one intra-op thread, not one per core of the machine."""
    code = ("import torch; from kiln.threads import configure_threads; "
            "print(configure_threads(), torch.get_num_threads())")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert out == ["1", "1"]


def test_engine_runs_with_the_threads_asked(restore_threads, engine):
    from kiln.runtime.frontend.llm_engine import LLMEngine

    llm_engine = LLMEngine(engine("llama"), threads=1)
    assert llm_engine.threads == 1 and torch.get_num_threads() == 1
