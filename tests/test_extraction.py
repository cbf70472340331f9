"""Loading an aoti engine leaves nothing behind (kiln/engine/extraction.py): each process unpacks
its engine once into its own folder under $KILN_CACHE_DIR/extracted, runs from it, and that folder
goes on every exit Kiln controls; what a SIGKILL leaves, the next process sweeps, never touching a
live process's folder. Nothing lands in $TMPDIR.

The processes under test get a fresh cache root holding a link to the C++ plugin library that this
process built (a fresh root would rebuild it, a minute per process) and a private $TMPDIR, which
must stay free of AOTInductor's `aotinductor_*` folders. Servers start in parallel where the test
does not need them one after another."""
import fcntl
import gc
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import httpx
import psutil
import pytest

from kiln import LLM
from kiln.config import ConfigError
from kiln.plugins import cpp
from kiln.engine import extraction
from kiln.engine.loader import RankEngine
from kiln.utils import free_ports

KILN = Path(sys.executable).parent / "kiln"


@pytest.fixture(scope="module")
def engine_dir(engine):
    return engine("llama", backend="aoti")


@pytest.fixture
def env(tmp_path) -> dict:
    cpp.ensure_built()
    cache = tmp_path / "cache"
    (cache / "torch_extensions").mkdir(parents=True)
    (cache / "torch_extensions" / cpp.build_dir().name).symlink_to(cpp.build_dir())
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "KILN_CACHE_DIR": str(cache), "TMPDIR": str(tmp_path / "tmp")}


def area(env) -> Path:
    return Path(env["KILN_CACHE_DIR"]) / "extracted"


class Server:
    def __init__(self, engine_dir: Path, env: dict, log: Path):
        self.port, self.log, self.env, self.model = free_ports(1)[0], log, env, str(engine_dir)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        self.proc = subprocess.Popen(
            [str(KILN), "serve", "--engine_dir", str(engine_dir), "--host", "127.0.0.1", "--port",
             str(self.port), "--no_access_log", "--threads", "1", "--max_tokens_in_paged_kv_cache", "256"],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 180) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kiln serve exited with {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    # the engine runs in the server's engine-core process
                    (self.core,) = [c for c in psutil.Process(self.proc.pid).children()
                                    if "kiln.runtime.core.core_process" in c.cmdline()]
                    self.folder = process_folder(area(self.env), self.core.pid)
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"kiln serve did not become healthy:\n{self.log.read_text()}")

    def complete(self) -> str:
        r = self.http.post("/v1/completions", json={
            "model": self.model, "prompt": "def f(x):", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def stop(self, sig=signal.SIGTERM) -> int:
        if sig == signal.SIGKILL:  # the whole pod at once: the engine core too, so that it cannot clean up
            self.kill_core()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=60)

    def kill_core(self) -> None:
        core = getattr(self, "core", None)
        if core is not None and core.is_running():
            core.kill()
            core.wait(60)


def process_folder(root: Path, pid: int) -> Path:
    (folder,) = [p for p in root.iterdir() if p.name.startswith(f"{pid}-")]
    return folder


def files(folder: Path) -> dict[str, tuple]:
    return {str(p.relative_to(folder)): (p.stat().st_ino, p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


def mapped_libraries(pid: int) -> set[str]:
    return {line.split(maxsplit=5)[5] for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if line.count(" ") >= 5 and ".so" in line}


def assert_runs_from_its_own_unpack(pid: int, folder: Path, package: Path, env: dict) -> None:
    """folder holds the lock and one complete unpack of package, whose library the process runs."""
    (unpacked,) = [p for p in folder.iterdir() if p.name != "lock"]
    assert unpacked.name.startswith("rank0.engine.")
    with zipfile.ZipFile(package) as z:
        expected = {i.filename: i.file_size for i in z.infolist() if not i.is_dir()}
    assert {name: size for name, (_, size, _) in files(unpacked).items()} == expected
    libraries = mapped_libraries(pid)
    (wrapper,) = [lib for lib in libraries if Path(lib).is_relative_to(unpacked)]
    assert wrapper.endswith(".wrapper.so") and Path(wrapper).is_file()
    assert not [lib for lib in libraries if lib.startswith((env["TMPDIR"], "/tmp/aotinductor"))]


def start_all(engine_dir, env, logs: Path, n: int) -> list[Server]:
    servers = [Server(engine_dir, env, logs / f"server{i}.log") for i in range(n)]
    try:
        return [s.wait_healthy() for s in servers]
    except BaseException:
        for s in servers:
            s.stop(signal.SIGKILL)
        raise


def test_restarts_by_sigterm_and_sigkill_leave_no_extraction_behind(engine_dir, env, tmp_path):
    package = engine_dir / "rank0.engine"
    killed = []
    for batch, (sig, n) in enumerate([(signal.SIGTERM, 3), (signal.SIGKILL, 3)]):  # a restart each, 3 at once
        (tmp_path / f"batch{batch}").mkdir()
        servers = start_all(engine_dir, env, tmp_path / f"batch{batch}", n)
        try:
            for s in servers:
                assert_runs_from_its_own_unpack(s.core.pid, s.folder, package, env)
            for s in servers:
                if sig == signal.SIGKILL:
                    s.kill_core()
                s.proc.send_signal(sig)
            for s in servers:
                code = s.proc.wait(timeout=60)
                if sig == signal.SIGTERM:
                    assert code == 0, s.log.read_text()
                    assert not s.folder.exists()  # gone at once, not left for the next sweep
                else:
                    assert code == -signal.SIGKILL and s.folder.is_dir()
                    killed.append(s.folder)
        finally:
            for s in servers:
                s.stop(signal.SIGKILL)
    assert sorted(area(env).iterdir()) == sorted(killed)

    (last,) = start_all(engine_dir, env, tmp_path, 1)
    try:
        assert list(area(env).iterdir()) == [last.folder]  # the killed servers' folders were swept
        assert_runs_from_its_own_unpack(last.core.pid, last.folder, package, env)
        last.complete()
        assert_runs_from_its_own_unpack(last.core.pid, last.folder, package, env)
        assert "loaded in" in last.log.read_text()
        assert last.stop() == 0
    finally:
        last.stop(signal.SIGKILL)
    assert list(area(env).iterdir()) == []
    assert list(Path(env["TMPDIR"]).glob("aotinductor_*")) == []


def dead_process() -> tuple[int, float]:
    p = subprocess.Popen(["sleep", "60"])
    start = psutil.Process(p.pid).create_time()
    p.kill()
    p.wait()
    return p.pid, start


def test_two_servers_on_one_engine_dir_keep_their_own_extractions(engine_dir, env, tmp_path):
    package = engine_dir / "rank0.engine"
    a = start_all(engine_dir, env, tmp_path, 1)[0]
    b = None
    try:
        a_files = files(a.folder)
        # For b's sweep, while a serves: the folder of a process that died, one naming a live pid
        # with another start time (the pid was reused), and one whose owner holds its flock but
        # whose pid we cannot see (it runs in another PID namespace): only the last is alive.
        pid, start = dead_process()
        dead = area(env) / f"{pid}-{start:.2f}"
        reused = area(env) / f"{os.getpid()}-{psutil.Process().create_time() - 3600:.2f}"
        pid, start = dead_process()
        elsewhere = area(env) / f"{pid}-{start:.2f}"
        for folder in (dead, reused, elsewhere):
            (folder / "rank0.engine.x").mkdir(parents=True)
            (folder / "lock").touch()
        lock = os.open(elsewhere / "lock", os.O_RDWR)
        fcntl.flock(lock, fcntl.LOCK_EX)

        b = Server(engine_dir, env, tmp_path / "b.log").wait_healthy()
        assert sorted(area(env).iterdir()) == sorted([a.folder, b.folder, elsewhere])
        assert files(a.folder) == a_files  # the same files: not rewritten, not replaced
        for s in (a, b):
            assert_runs_from_its_own_unpack(s.core.pid, s.folder, package, env)
        assert a.complete() == b.complete()

        assert b.stop() == 0
        assert not b.folder.exists() and files(a.folder) == a_files
        a.complete()
        assert a.stop() == 0
        assert list(area(env).iterdir()) == [elsewhere]
    finally:
        for s in (a, b):
            if s is not None:
                s.stop(signal.SIGKILL)
    os.close(lock)  # its owner is gone now: the next sweep takes it
    assert extraction.sweep(area(env)) == [elsewhere] and list(area(env).iterdir()) == []


EXITS = '''
import faulthandler
import multiprocessing as mp
import os
import signal
import sys
import time
from pathlib import Path

# A process still here after this long is stuck: its threads' stacks go to the log, and it exits
# (a child sooner than its parent, whose exit ends the test's wait and so the log it reads).
faulthandler.dump_traceback_later(150 if __name__ == "__main__" else 120, exit=True)
faulthandler.register(signal.SIGUSR1, all_threads=True)

# Ctrl+C raises KeyboardInterrupt even where the test runs as a background job (which ignores SIGINT)
signal.signal(signal.SIGINT, signal.default_int_handler)


def load(done=None, then="return"):
    from kiln.engine import extraction
    from kiln.engine.loader import RankEngine

    engine = RankEngine(sys.argv[2], max_tokens_in_paged_kv_cache=64)
    folder = extraction.process_folder()
    assert [p.name.split(".")[:2] for p in folder.iterdir() if p.name != "lock"] == [["rank0", "engine"]]
    print(folder, flush=True)
    if done is not None:
        done.put(None)
    if then == "wait":
        time.sleep(600)


if __name__ == "__main__":
    if sys.argv[1] == "children":  # a child that returns and one that is terminated, then our own
        ctx = mp.get_context("spawn")
        done = ctx.Queue()
        children = [ctx.Process(target=load, args=(done, then)) for then in ("return", "wait")]
        for c in children:
            c.start()
        done.get(), done.get()
        children[1].terminate()
        for c in children:
            c.join(90)
            if c.is_alive():  # say which, where its threads wait, and ask for its Python stacks
                tasks = [f"{t.name}: " + open(t / "wchan").read() + " " + open(t / "syscall").read().split()[0]
                         for t in Path(f"/proc/{c.pid}/task").iterdir()]
                print(f"child {children.index(c)} (pid {c.pid}) still alive:", tasks, file=sys.stderr, flush=True)
                os.kill(c.pid, signal.SIGUSR1)
                c.join()
        print("exit codes", [c.exitcode for c in children], flush=True)
    load(then=sys.argv[1])
'''


def test_every_exit_path_removes_the_process_folder(engine_dir, env, tmp_path):
    """Multiprocessing children that return or are terminated, a normal exit, and SIGTERM and SIGINT
    to a process that loaded an engine in its main thread: none leaves a folder for a sweep."""
    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    modes = {"children": "children", "terminate": "wait", "interrupt": "wait"}
    runs = {how: subprocess.Popen([sys.executable, str(script), mode, str(engine_dir)], env=env,
                                  stdout=subprocess.PIPE, stderr=open(tmp_path / f"{how}.log", "w"), text=True)
            for how, mode in modes.items()}
    folders = {}
    try:
        for how, proc in runs.items():
            lines = [proc.stdout.readline() for _ in range(2 if how == "children" else 1)]  # once loaded
            assert all(lines), (tmp_path / f"{how}.log").read_text()
            folders[how] = [Path(line.strip()) for line in lines]
            assert all(f.parent == area(env) for f in folders[how])
        assert folders["terminate"][0].is_dir() and folders["interrupt"][0].is_dir()
        runs["terminate"].send_signal(signal.SIGTERM)
        runs["interrupt"].send_signal(signal.SIGINT)
        codes = {how: proc.wait(timeout=200) for how, proc in runs.items()}
    finally:
        for proc in runs.values():
            proc.kill()
    logs = "\n".join(f"-- {how}:\n{(tmp_path / f'{how}.log').read_text()}" for how in runs)
    assert codes["children"] == 0 and codes["terminate"] == -signal.SIGTERM, logs  # it still dies of the signal
    rest = runs["children"].stdout.read().splitlines()
    assert rest[0] == "exit codes [0, -15]", logs
    folders["children"].append(Path(rest[1]))
    assert [f for fs in folders.values() for f in fs if f.exists()] == []
    assert list(area(env).iterdir()) == []
    assert list(Path(env["TMPDIR"]).glob("aotinductor_*")) == []


def test_an_engine_failing_to_load_or_released_leaves_nothing(engine_dir, env, tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_DIR", env["KILN_CACHE_DIR"])
    monkeypatch.setenv("TMPDIR", env["TMPDIR"])
    broken = tmp_path / "broken"
    shutil.copytree(engine_dir, broken)
    with zipfile.ZipFile(engine_dir / "rank0.engine") as src, \
            zipfile.ZipFile(broken / "rank0.engine", "w") as dst:  # a library that is none
        for item in src.infolist():
            dst.writestr(item, b"garbage" if item.filename.endswith(".so") else src.read(item))
    with pytest.raises(ConfigError, match="is not a loadable aoti engine"):
        RankEngine(broken)
    folder = extraction.process_folder()
    assert [p.name for p in folder.iterdir()] == ["lock"]

    llm = LLM(engine_dir, threads=1, max_tokens_in_paged_kv_cache=64)
    (unpacked,) = [p for p in folder.iterdir() if p.name != "lock"]
    assert_runs_from_its_own_unpack(os.getpid(), folder, engine_dir / "rank0.engine", env)
    del llm
    gc.collect()
    assert not unpacked.exists() and list(Path(env["TMPDIR"]).glob("aotinductor_*")) == []
