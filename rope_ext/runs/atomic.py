"""A folder written whole or not at all: the work goes into a temporary folder beside the target, which replaces the
target only once everything is in it (``rope-ext export``, ``rope-ext corpus``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def written_whole(out: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """A temporary folder named ``prefix...`` beside ``out`` to write into. When the block ends without an error it
    replaces ``out`` (removed first where it exists), its files and folders given the modes the umask gives (a
    temporary file or folder is private); on an error nothing is left."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=prefix) as work:
        work_path = Path(work)
        yield work_path
        mask = os.umask(0)
        os.umask(mask)
        for item in [work_path, *work_path.rglob("*")]:
            os.chmod(item, (0o777 if item.is_dir() else 0o666) & ~mask)
        if os.path.lexists(out):
            shutil.rmtree(out)
        os.replace(work_path, out)
        work_path.mkdir()  # (for the context manager's cleanup)
