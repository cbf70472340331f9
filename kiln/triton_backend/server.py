"""`kiln triton-serve`: runs `tritonserver` on a repository. The one on PATH (NGC's container, with
its own backends and Python), or else the binary in the `nvidia-pytriton` wheel, with a Python
backend directory holding the stub for this interpreter's version and PYTHONPATH set so that the
stub (the system's Python, in isolated mode: each model.py puts PYTHONPATH's entries on sys.path)
imports kiln and this environment's packages; the stub's PATH starts with a `python3` of the
libpython it loads, so that an activated virtualenv does not lend it another build's stdlib."""
import ctypes.util
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import kiln
from kiln.triton_backend.repository import needs_auto_complete

CACHE = Path(os.environ.get("KILN_CACHE", Path.home() / ".cache" / "kiln"))


class LaunchError(RuntimeError):
    pass


def python_path() -> str:
    """kiln's root (an editable install has no other trace the stub would follow) and this
    environment's site-packages, before whatever PYTHONPATH already holds."""
    paths = sysconfig.get_paths()
    entries = [str(Path(kiln.__file__).resolve().parent.parent), paths["purelib"], paths["platlib"],
               *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    return os.pathsep.join(dict.fromkeys(e for e in entries if e))


def pytriton_server() -> tuple[Path, Path, Path]:
    """(tritonserver, its libraries, a backend directory) from the nvidia-pytriton wheel."""
    try:
        import pytriton
    except ImportError:
        raise LaunchError("no tritonserver on PATH, and nvidia-pytriton is not installed: run in NGC's Triton "
                          "container, or pip install 'kiln-llm[triton]'") from None
    from importlib.metadata import version

    dist = Path(pytriton.__file__).parent / "tritonserver"
    libs = dist.parent.parent / "nvidia_pytriton.libs"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / py / "triton_python_backend_stub"
    if not stub.is_file():
        raise LaunchError(f"nvidia-pytriton has no Python-backend stub for Python {py}")
    if ctypes.util.find_library(f"python{py}") is None:
        raise LaunchError(f"the Python-backend stub for Python {py} needs the system's libpython{py}.so "
                          f"(e.g. apt install libpython{py})")
    backends = CACHE / "tritonserver" / f"pytriton-{version('nvidia-pytriton')}-py{py}" / "backends"
    if not (backends / "python" / "triton_python_backend_stub").is_file():
        backends.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=backends.parent))
        (tmp / "python").mkdir()
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(dist / "backends" / "python" / f, tmp / "python" / f)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        try:
            tmp.rename(backends)
        except OSError:  # another launch got there first
            shutil.rmtree(tmp)
    add_tensorrtllm_backend(backends)
    return dist / "bin" / "tritonserver", libs, backends


def add_tensorrtllm_backend(backends: Path) -> None:
    """Kiln as the Python-based backend `tensorrtllm` (Triton runs `<backends>/<name>/model.py` for a
    model whose config names a backend without a shared library): a repository written for
    TensorRT-LLM's own backend then loads unchanged (kiln/triton_backend/upstream.py)."""
    from kiln.triton_backend.upstream import BACKEND, backend_model

    path, text = backends / BACKEND / "model.py", backend_model()
    if path.is_file() and path.read_text() == text:
        return
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".model.py.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def command(repo, address: str, http_port: int, grpc_port: int, metrics_port: int, exit_timeout: int,
            extra: tuple[str, ...] = ()) -> tuple[list[str], dict]:
    env = dict(os.environ, PYTHONPATH=python_path())
    args = [f"--model-repository={Path(repo).resolve()}", f"--http-address={address}", f"--http-port={http_port}",
            f"--grpc-address={address}", f"--grpc-port={grpc_port}", f"--metrics-address={address}",
            f"--metrics-port={metrics_port}", f"--exit-timeout-secs={exit_timeout}",
            ]
    if not needs_auto_complete(repo):  # the configs are complete: load each model once, not twice
        args.append("--disable-auto-complete-config")
    exe = shutil.which("tritonserver")
    if exe is None:
        server, libs, backends = pytriton_server()
        exe = str(server)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(libs), env.get("LD_LIBRARY_PATH")]))
        python = stub_python(backends, env)
        if python is not None:
            env["PATH"] = os.pathsep.join(filter(None, [str(python), env.get("PATH")]))
        args.append(f"--backend-directory={backends}")
    return [exe, *args, *extra], env


def stub_python(backends: Path, env: dict) -> Path | None:
    """A folder whose `python3` is the interpreter of the libpython the stub loads (what `ldd`
    resolves under env), to put first on the stub's PATH; None where that cannot be told.

    The stub's embedded Python finds its standard library from the `python3` first on PATH (it runs
    isolated: PYTHONHOME is ignored). In an activated virtualenv that is the venv's base interpreter
    (pyenv's 3.11.7, say), whose compiled modules fail in the system's libpython (Debian's 3.11.2:
    `_ssl...so: undefined symbol: _PyModule_Add`)."""
    py = f"python{sys.version_info.major}.{sys.version_info.minor}"
    stub = backends / "python" / "triton_python_backend_stub"
    try:
        out = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, env=env, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    lib = next((line.split("=>")[1].split()[0] for line in out.splitlines()
                if f"lib{py}.so" in line and "=>" in line and "not found" not in line), None)
    home = lib and next((d for d in Path(lib).resolve().parents if (d / "lib" / py / "os.py").is_file()), None)
    if home is None or not (home / "bin" / py).is_file():
        return None
    folder = backends.parent / ("stub-python" + str(home).replace(os.sep, "_"))
    if not (folder / "python3").is_symlink():
        tmp = Path(tempfile.mkdtemp(dir=backends.parent))
        (tmp / "python3").symlink_to(home / "bin" / py)
        try:
            tmp.rename(folder)
        except OSError:  # another launch got there first
            shutil.rmtree(tmp)
    return folder


def serve(repo, address: str, http_port: int, grpc_port: int, metrics_port: int, exit_timeout: int,
          extra: tuple[str, ...] = (), ready_timeout: float = 600, log=print) -> int:
    """Start tritonserver, wait until it is ready, forward SIGINT/SIGTERM to it; its exit status."""
    cmd, env = command(repo, address, http_port, grpc_port, metrics_port, exit_timeout, extra)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    relay = threading.Thread(target=relay_output, args=(proc.stdout, env, log), name="kiln-triton-log", daemon=True)
    relay.start()
    forwarded = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        forwarded[sig] = signal.signal(sig, lambda s, _: proc.send_signal(s))
    try:
        host = "127.0.0.1" if address in ("0.0.0.0", "") else address
        if _wait_ready(proc, f"http://{host}:{http_port}/v2/health/ready", ready_timeout):
            log(f"tritonserver ready: HTTP {host}:{http_port}, gRPC {host}:{grpc_port}, "
                f"metrics http://{host}:{metrics_port}/metrics")
        elif proc.poll() is None:
            log(f"tritonserver is not ready after {ready_timeout:g} s; stopping it")
            proc.terminate()
        else:
            log(f"tritonserver exited with status {proc.returncode} before it was ready")
        code = proc.wait()
        relay.join(timeout=10)
    finally:
        for sig, handler in forwarded.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code if code >= 0 else 128 - code


def _wait_ready(proc: subprocess.Popen, url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except OSError:
            pass
        time.sleep(0.5)
    return False


def relay_output(stream, env: dict, log) -> None:
    """tritonserver's output to ours, line by line; a stub that cannot start because its interpreter
    is another build's gets one line saying so and what to do."""
    hinted = False
    for line in stream:
        sys.stdout.write(line)
        sys.stdout.flush()
        if not hinted and "undefined symbol" in line and ("lib-dynload" in line or "Python stub" in line):
            hinted = True
            python = shutil.which("python3", path=env.get("PATH")) or "none"
            log(f"kiln triton-serve: a Python-backend stub could not start its interpreter: it embeds the "
                f"system's libpython{sys.version_info.major}.{sys.version_info.minor} and took its standard library "
                f"from the first python3 on PATH ({python} -> {os.path.realpath(python)}), another build's; put a "
                "python3 of that libpython's prefix first on PATH (e.g. a folder with python3 -> /usr/bin/python3."
                f"{sys.version_info.minor}), or deactivate the virtualenv or conda environment")
