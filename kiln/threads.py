"""How many intra-op threads an engine runs with, so that they never outnumber the cores it may use.

A compiled step is a sequence of OpenMP parallel regions, each as slow as its slowest thread: one
thread more than there are cores, or a core taken by another busy thread, stalls every region.
"""
import math
import os
from pathlib import Path

import torch


def available_cpus() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    or a Kubernetes pod's CPU limit, which affinity does not show)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
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
    torch.set_num_threads(threads)
    # The tokenizers library runs a thread pool of its own (one thread per core) for batch encoding;
    # while a step runs those threads would take cores from the intra-op threads.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return threads
