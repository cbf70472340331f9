"""Intra-op threads: --threads, then OMP_NUM_THREADS, then the cores the process may use."""
import os
import subprocess
import sys
from pathlib import Path

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


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "INFINITE"}])
def test_spinning_openmp_settings_are_warned_of(restore_threads, monkeypatch, env):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        configure_threads(1)  # the defaults: no warning
        monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
        configure_threads(1)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.warns(RuntimeWarning, match="idle OpenMP threads spinning.*Unset it"):
        configure_threads(1)


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


def _tree(root, files: dict) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_quota_from_cgroup_v2_and_v1_trees(tmp_path):
    """The process's own cgroup and its ancestors, the tightest quota winning, fractional as set."""
    from kiln.threads import cpu_quota

    v2 = tmp_path / "v2"
    _tree(v2, {"proc": "0::/pod/app\n", "pod/cpu.max": "150000 100000\n", "pod/app/cpu.max": "max 100000\n"})
    assert cpu_quota(v2, v2 / "proc") == 1.5
    _tree(v2, {"pod/app/cpu.max": "50000 100000\n"})
    assert cpu_quota(v2, v2 / "proc") == 0.5
    v1 = tmp_path / "v1"
    _tree(v1, {"proc": "4:memory:/x\n3:cpu,cpuacct:/job\n1:name=systemd:/\n",
               "cpu,cpuacct/job/cpu.cfs_quota_us": "250000\n", "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
               "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(v1, v1 / "proc") == 2.5
    _tree(tmp_path / "none", {"proc": "0::/\n", "cpu.max": "max 100000\n"})
    assert cpu_quota(tmp_path / "none", tmp_path / "none" / "proc") is None
    assert cpu_quota(tmp_path / "missing", tmp_path / "missing" / "proc") is None


def _cpu_cgroup(tmp_name: str, quota: float):
    """A real CPU cgroup limited to `quota` CPUs (its cgroup.procs), or None where one cannot be made."""
    v2 = Path("/sys/fs/cgroup")
    try:
        if (v2 / "cgroup.controllers").is_file():
            group = v2 / tmp_name
            group.mkdir(exist_ok=True)
            (group / "cpu.max").write_text(f"{int(quota * 100000)} 100000")
        else:
            group = v2 / "cpu" / tmp_name
            group.mkdir(exist_ok=True)
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text(str(int(quota * 100000)))
        return group
    except OSError:
        return None


@pytest.mark.parametrize("quota,threads", [(0.5, 1), (1.5, 2)])
def test_threads_follow_a_real_cgroup_quota(quota, threads):
    """A process started inside a CPU-limited cgroup runs ceil(quota) threads (at most its affinity),
    in torch and in the kiln_cpp kernels' pool alike."""
    group = _cpu_cgroup(f"kiln-test-{os.getpid()}", quota)
    if group is None:
        pytest.skip("no writable CPU cgroup here (needs root and a cgroup v2 or v1 cpu hierarchy)")
    try:
        code = ("import torch; from kiln.plugins import cpp; from kiln.threads import configure_threads; "
                "n = configure_threads(); cpp.load(); print(n, torch.ops.kiln_cpp.num_threads())")
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        procs = group / "cgroup.procs"
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                             preexec_fn=lambda: procs.write_text(str(os.getpid()))).stdout.split()
        expected = min(threads, len(os.sched_getaffinity(0)))
        assert out == [str(expected), str(expected)]
    finally:
        group.rmdir()
