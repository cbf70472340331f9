"""Where aoti engines are unpacked to run: one folder per process under the Kiln cache root, gone
when the process is.

AOTInductor's loader runs a package's shared library from files on disk. Given the package, it
unpacks it into $TMPDIR/aotinductor_XXXXXX, which only its destructor removes (never run on a signal
or a crash); given a file object, torch first copies the whole package to a temporary file as well.
So Kiln unpacks each rank's package itself, once, into

    $KILN_CACHE_DIR/extracted/<pid>-<process start time>/rank0.engine.XXXXXXXX/

and loads that folder, from which the loader runs without writing anything. The folder stays while
its model lives (a CUDA engine may read its kernels from it lazily). The process's folder goes at
exit: a normal exit or an exception, SIGINT, the server's SIGTERM drain, the end of a multiprocessing
child, and SIGTERM or SIGHUP to a process that loaded its engine in the main thread and has no handler
of its own for them (it still dies of the signal). What a SIGKILL or a crash leaves is removed by the
next process that loads an engine with the same cache root.

A folder's owner counts as alive while it holds the flock on the folder's `lock` (the kernel drops
it when the process dies, whatever PID namespace it ran in) or while a process with its pid and
start time runs (a reused pid has another start time); only a folder whose owner fails both is
removed, so a live process's folder is never swept.
"""
import atexit
import fcntl
import multiprocessing.util
import os
import shutil
import signal
import tempfile
import threading
import weakref
import zipfile
from pathlib import Path

import psutil

from kiln.plugins.cpp import cache_root

_guard = threading.RLock()  # the signal handler may take it in the thread holding it
_pid: int | None = None  # the process that made the folders in _own
_own: dict[Path, int] = {}  # this process's folders (one per cache root it used) -> fd holding the flock


class UnpackError(OSError):
    """An engine could not be unpacked (no space, no permission): the disk's fault, not the engine's."""


def area() -> Path:
    """Where every process's folder lives; deploy/ mounts an emptyDir here."""
    return cache_root() / "extracted"


def load_unpacked(package: Path, load):
    """load(folder) for a folder of this process's holding the package's files, which is removed when
    the model load returns is garbage-collected, or at exit."""
    folder = unpack(package)
    try:
        model = load(folder)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    weakref.finalize(model, _discard, folder, os.getpid())
    return model


def unpack(package: Path) -> Path:
    """A new folder of this process's holding the files of the package (a zip archive), written once."""
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix=f"{package.name}.", dir=process_folder()))
        with zipfile.ZipFile(package) as archive:  # a bad archive raises BadZipFile, not OSError
            archive.extractall(folder)
        return folder
    except BaseException as e:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        if isinstance(e, OSError):
            raise UnpackError(f"cannot unpack {package} into {area()}: {e.strerror or e}; set $KILN_CACHE_DIR "
                              f"to a writable folder with room for the engine") from None
        raise


def process_folder() -> Path:
    """This process's folder under area(), made (after a sweep) on first use."""
    global _pid
    with _guard:
        pid = os.getpid()
        if _pid != pid:  # the first use, or a forked child's: the parent's folders are not ours
            for fd in _own.values():
                os.close(fd)
            _own.clear()
            _pid = pid
            _register_cleanup()
        root = area()
        folder = root / f"{pid}-{psutil.Process(pid).create_time():.2f}"
        if folder in _own and folder.is_dir():
            return folder
        root.mkdir(parents=True, exist_ok=True)
        sweep(root)
        folder.mkdir(exist_ok=True)
        fd = os.open(folder / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocks only while a sweep looks at it
        except OSError:  # a filesystem without flock: the pid and start time still vouch for us
            pass
        if folder in _own:  # removed under us (by hand): start again
            os.close(_own[folder])
        _own[folder] = fd
        return folder


def sweep(root: Path | None = None) -> list[Path]:
    """Removes the folders under root (default area()) whose owners are gone; returns them."""
    root = area() if root is None else root
    removed = []
    try:
        folders = list(root.iterdir())
    except FileNotFoundError:
        return removed
    for folder in folders:
        owner = _owner(folder.name)
        if owner is None or not folder.is_dir() or _running(*owner):
            continue
        try:
            fd = os.open(folder / "lock", os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # its owner died before it took the lock
            fd = None
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive where we cannot see its pid (another PID namespace)
                except OSError:
                    pass  # no flock on this filesystem: the pid check above decides
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
        finally:
            if fd is not None:
                os.close(fd)
    return removed


def _owner(name: str) -> tuple[int, float] | None:
    pid, _, start = name.partition("-")
    try:
        return int(pid), float(start)
    except ValueError:
        return None


def _running(pid: int, start: float) -> bool:
    try:
        p = psutil.Process(pid)
        # psutil derives the start time from the boot time, which moves when the clock is set: a
        # second of slack (the flock covers the rest).
        return abs(p.create_time() - start) < 1.0 and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # not ours to inspect: assume alive
        return True


def _remove_own() -> None:
    with _guard:
        if _pid != os.getpid():  # a forked child never removes its parent's folders
            return
        owned = list(_own.items())
        _own.clear()
    for folder, fd in owned:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(fd)


def _discard(folder: Path, pid: int) -> None:
    if os.getpid() == pid:  # not from a forked child that inherited the finalizer
        shutil.rmtree(folder, ignore_errors=True)


def _on_signal(signum, frame) -> None:
    _remove_own()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of it, as the process would have without us


def _register_cleanup() -> None:
    atexit.register(_remove_own)
    # A multiprocessing child ends with os._exit, after its finalizers but without atexit.
    multiprocessing.util.Finalize(None, _remove_own, exitpriority=0)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _on_signal)
