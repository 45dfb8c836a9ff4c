"""One sidecar per batches.dir: two feeding the same batches would each send every line.

An exclusive flock on a file inside the directory, held while the store is open (the kernel
drops it when the process ends, a SIGKILL included, so a restart never finds a stale lock).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib

LOCK_FILE = "batches.lock"


class DirectoryInUse(Exception):
    """Another process holds batches.dir."""


class DirectoryLock:
    """Held from `acquire` to `release`."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.path = directory / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock; DirectoryInUse (naming the holder's pid where it wrote it) when another
        process has it. OSError when the file cannot be made."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise DirectoryInUse(
                f"another llamaswap sidecar{f' (pid {holder})' if holder.isdigit() else ''} keeps its batches in "
                f"{self.path.parent}: give each sidecar its own batches.dir, or stop the other one") from exc
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = None
