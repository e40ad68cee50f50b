"""One authority per tier folder: an exclusive advisory lock on a file inside the folder.

A worker's disk tier is acted on by exactly one tier manager (the in-engine adapter's
:class:`~nexuskv.dataplane.tiers.TierManager`, or the one the service :mod:`streams.tier_manager`
runs): two managers over one folder would each evict, demote and garbage-collect what the other
holds and announce facts the other contradicts. The manager takes :class:`FolderLock` on every
managed folder when it opens it — ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<folder>/.nexuskv-tier.lock``,
which then holds the holder's pid and name — and a second authority fails at start with
:class:`~nexuskv.errors.TierLockedError`, naming the folder and the holder. The lock goes with the
holder's file descriptor: :meth:`FolderLock.release` (the manager's ``close``), or the process's
exit, however it ends. Readers that never change the folder (``disk.stored_header``, SGLang's
``FolderSource``) take no lock. The file itself stays (removing it would let a third process lock a
new file while a second still holds the old one).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path

from nexuskv.errors import TierLockedError, TierUnavailableError

__all__ = ["LOCK_FILE", "FolderLock"]

LOCK_FILE = ".nexuskv-tier.lock"


class FolderLock:
    """The exclusive lock on ``folder`` for ``holder`` (a name for the error a second authority gets)."""

    def __init__(self, folder: Path | str, *, holder: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.holder = holder
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise TierUnavailableError(f"tier folder {self.folder}: cannot open its lock file: {exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = _read(fd)
            os.close(fd)
            raise TierLockedError(
                f"tier folder {self.folder} is already held by another tier manager "
                f"({other or 'holder unknown'}); one folder has one authority: stop that one, or give this "
                f"one a folder of its own (lock file {self.path})") from None
        except OSError as exc:
            os.close(fd)
            raise TierUnavailableError(f"tier folder {self.folder}: cannot lock {self.path}: {exc}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, {holder}\n".encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Let the folder go (idempotent)."""
        fd = getattr(self, "_fd", None)
        self._fd = None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # closing the descriptor releases the flock

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:  # a holder dropped without close still lets the folder go
        self.release()


def _read(fd: int) -> str:
    with contextlib.suppress(OSError):
        return os.pread(fd, 512, 0).decode(errors="replace").strip()
    return ""
