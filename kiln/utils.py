"""Small helpers shared by the pipeline's stages."""
import os
import resource
import shutil
import sys
import uuid
from pathlib import Path

from tqdm import tqdm


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


def progress(**kwargs):
    return tqdm(file=sys.stderr, disable=kwargs.pop("disable", None), **kwargs)
