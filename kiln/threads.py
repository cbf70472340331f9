"""How many intra-op threads an engine runs with, so that they never outnumber the cores it may use.

A step's kernels share out their loops among the threads that run (kiln/plugins/csrc/thread_pool.h),
but a thread more than there are cores still only adds switching: the count follows what the
process may use.
"""
import math
import os
import warnings
from pathlib import Path

import torch


def cpu_quota(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """The CPUs a cgroup CPU quota allows this process (a container's or a Kubernetes pod's CPU
    limit, which affinity does not show), fractional as set; None without one. Reads the process's
    own cgroup and its ancestors (the tightest limit wins), cgroup v2 `cpu.max` or v1
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    v2, v1 = None, None
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = (path, next((d for d in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu") if d.is_dir()),
                             root / "cpu"))
    limits = []

    def walk(base: Path, path: str):
        parts = [p for p in path.strip("/").split("/") if p]
        return [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]

    for group in walk(root, v2) if v2 is not None else []:
        try:
            quota, period = (group / "cpu.max").read_text().split()[:2]
            if quota != "max":
                limits.append(int(quota) / int(period))
        except (OSError, ValueError):
            pass
    for group in walk(v1[1], v1[0]) if v1 is not None else []:
        try:
            quota = int((group / "cpu.cfs_quota_us").read_text())
            if quota > 0:
                limits.append(quota / int((group / "cpu.cfs_period_us").read_text()))
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup CPU quota rounded up (a
    1.5-CPU limit runs 2 threads: benchmarks/contention.py measures them at 0.65-0.84x of quiet
    speed under it, where 1 thread is bounded by 0.5x)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota - 1e-9)))
    return cpus


def configure_threads(threads: int | None = None) -> int:
    """Sets torch's intra-op threads to `threads`, else $OMP_NUM_THREADS, else `available_cpus()`,
    and returns the number. torch's own default counts every core of the machine, quota or not."""
    if threads is None:
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if env:
            try:
                threads = int(env.split(",")[0])
            except ValueError:
                raise ValueError(f"OMP_NUM_THREADS={env!r} is not a number of threads") from None
        else:
            threads = available_cpus()
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)  # the kiln_cpp kernels' pool follows it
    warn_spinning_openmp()
    # The tokenizers library runs a thread pool of its own (one thread per core) for batch encoding;
    # while a step runs those threads would take cores from the intra-op threads.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return threads


def warn_spinning_openmp() -> None:
    """Warns where OpenMP's idle threads are told to spin without end (CPU tuning guides suggest it).
    The kernels run on Kiln's own pool, and once any ATen op has started an OpenMP team, its idle
    threads take the cores the pool needs: a Mixtral-shaped int4 engine's batch-16 step went from
    8.5 to 15.8 ms, with a spinning libgomp thread taking 38% of the CPU."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().lower()
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip().lower()
    if policy == "active" or spin == "infinite":
        setting = "OMP_WAIT_POLICY=ACTIVE" if policy == "active" else "GOMP_SPINCOUNT=infinite"
        warnings.warn(f"kiln: {setting} keeps idle OpenMP threads spinning, on the cores Kiln's kernels run "
                      "on (their own thread pool, not OpenMP): steps can take twice as long. Unset it.",
                      RuntimeWarning, stacklevel=3)
