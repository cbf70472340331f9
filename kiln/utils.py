"""Small helpers shared by the pipeline's stages."""
import os
import resource
import shutil
import socket
import sys
import uuid
from pathlib import Path

from tqdm import tqdm


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: the sockets are held together, so that no two calls of bind(0)
    hand out the same one (tritonserver refuses HTTP and metrics on one port)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its finished children (compile workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def replace_dir(new: Path, dst: Path) -> None:
    """Move a finished output dir into place; an existing dst is swapped out, then removed."""
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(dst, old)
        os.replace(new, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(new, dst)


def child_env() -> dict[str, str]:
    """The environment of a `python -m kiln...` child process: this process's, with the kiln package
    it runs first on PYTHONPATH, so that the child imports the same code, installed or not."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[1])] + paths))


def expand_lists(args: list[str], lists: tuple[str, ...]) -> list[str]:
    """Command-line `args` with the values after a list option (argparse's nargs='+', as vLLM's and
    TensorRT-LLM's CLIs take them) as if the option were repeated before each; `--x=a b` too."""
    out, listing = [], None
    for arg in args:
        if arg.startswith("-"):
            listing = next((o for o in lists if arg == o or arg.startswith(o + "=")), None)
            if listing and arg != listing:
                out.extend([listing, arg.split("=", 1)[1]])
                continue
        elif listing and out[-1] != listing:
            out.append(listing)
        out.append(arg)
    return out


def progress(**kwargs):
    return tqdm(file=sys.stderr, disable=kwargs.pop("disable", None), **kwargs)


ISA_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "neon", "asimd", "sve")


def cpu_summary() -> str:
    """The CPU model and the SIMD features the kernels choose by, for benchmark reports (what wins
    on one CPU can lose on another)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model == "unknown CPU":
                model = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:  # x86, Arm
                flags = set(value.split())
    except OSError:
        pass
    have = [f for f in ISA_FLAGS if f in flags]
    return f"cpu: {model}, {os.cpu_count()} logical cores; flags: {' '.join(have) or 'none of ' + ', '.join(ISA_FLAGS)}"
