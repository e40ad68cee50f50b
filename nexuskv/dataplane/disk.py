"""The local disk tier: one file per payload, a packed header in front of the data.

Layout: ``<root>/<descriptor id>/g<group>/<key as 32 hex digits>.nkv``, each file the 128-byte
:class:`~nexuskv.dataplane.payload.PayloadHeader` followed by the payload bytes. A payload is
written to a temporary name and renamed into place, so a crash never leaves a torn payload
under a real name; a restarted backend rebuilds its index from the headers on disk (payloads
survive the process: ``durable``). A read is one ``readv`` of the header and the payload
straight into the destination buffer (one copy from the page cache), a write one ``writev``;
``fsync=True`` makes commits wait for the device as well. Writes go through the native core
(:func:`nexuskv._native.write_payload_files`), many files per call with the GIL released
(:meth:`DiskBackend.commit_views`: the tier manager hands it a save's blocks at once), so the
thread writing them does not take the GIL back from an engine's step thread after every syscall. Plain files rather than memory maps:
a map would save the copy on reads but fault in every page on first touch, and a payload is read
whole into the buffer it is kept or sent from anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from nexuskv.dataplane.backend import Reservation, StagedBackend, host_view
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.cuda import cuda_available
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHandle, PayloadHeader, PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.errors import DataPlaneError, IntegrityError, TierFullError, TierUnavailableError

__all__ = ["DiskBackend", "payload_file", "stored_header"]

log = logging.getLogger(__name__)
_SUFFIX = ".nkv"


def _folder(root: str, key: PayloadKey) -> str:
    return os.path.join(root, key.descriptor_id, f"g{key.group}")


def payload_file(root: Path | str, key: PayloadKey) -> str:
    """The file a disk tier rooted at ``root`` keeps ``key`` in (the same in every process)."""
    return f"{_folder(str(root), key)}/{key.key:032x}{_SUFFIX}"


def stored_header(root: Path | str, key: PayloadKey) -> PayloadHeader | None:
    """The header of ``key``'s file under ``root`` as it is now, whichever process wrote it.

    None when there is no such file, or it is not ``key``'s whole payload. For a process that
    shares the folder with the tier's owner but not its in-memory index (a scheduler checking
    what a worker wrote); it never changes the folder, unlike constructing a second backend on it.
    """
    path = payload_file(root, key)
    try:
        with open(path, "rb") as fh:
            header = PayloadHeader.unpack(fh.read(HEADER_BYTES))
        size = os.stat(path).st_size
    except (OSError, IntegrityError):
        return None
    return header if header.key == key and size == HEADER_BYTES + header.nbytes else None


def _native_writer():
    """The native core's batched payload-file writer (the disk tier's only write path)."""
    try:
        from nexuskv._native import write_payload_files
    except ImportError as exc:
        raise TierUnavailableError(f"the disk tier writes with nexuskv._native.write_payload_files, which is not "
                                   f"importable ({exc}): rebuild the native core (pip install -e .)") from None
    return write_payload_files


class DiskBackend(StagedBackend):
    """Payload files under ``root``, at most ``capacity_bytes`` of payload data."""

    def __init__(self, root: Path | str, capacity_bytes: int, *, label: str = "disk-files", fsync: bool = False) -> None:
        caps = Capabilities(tier=Tier.DISK, device="cpu", transport="file", durable=True,
                            note="files in the page cache; fsync on commit" if fsync else "files; no fsync on commit")
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=caps, pin=cuda_available())
        self.root = Path(root)
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailableError(f"{label}: cannot create {self.root}: {exc}") from None
        self._index: dict[PayloadKey, PayloadHeader] = {}
        self._pending: set[PayloadKey] = set()
        self._dirs: set[str] = set()
        self._root = str(self.root)
        self._folders: dict[tuple[str, int], str] = {}
        self._write_files = _native_writer()
        self._scan()

    @property
    def folder(self) -> Path:  # type: ignore[override]
        return self.root

    def path(self, key: PayloadKey) -> Path:
        """The file that holds (or would hold) ``key``."""
        return Path(self._file(key))

    def _file(self, key: PayloadKey) -> str:
        # Plain string joins: pathlib costs ~15 µs a payload, a fifth of a 64 KiB copy.
        folder = self._folders.get((key.descriptor_id, key.group))
        if folder is None:
            folder = _folder(self._root, key)
            self._folders[(key.descriptor_id, key.group)] = folder
        return f"{folder}/{key.key:032x}{_SUFFIX}"

    def _scan(self) -> None:
        """Rebuild the index from the files' headers; leftovers of interrupted writes are removed."""
        for path in self.root.rglob("*"):
            if not path.is_file():
                continue
            if path.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            if not path.name.endswith(_SUFFIX):
                continue
            try:
                with open(path, "rb") as fh:
                    header = PayloadHeader.unpack(fh.read(HEADER_BYTES))
                size = path.stat().st_size
            except (OSError, IntegrityError) as exc:
                log.warning("%s: ignoring unreadable payload file %s (%s)", self.label, path.name, exc)
                continue
            if self.path(header.key) != path or size != HEADER_BYTES + header.nbytes:
                log.warning("%s: ignoring payload file %s: its header or size does not match its name", self.label,
                            path.name)
                continue
            self._index[header.key] = header
            self._used += header.nbytes

    def header(self, key: PayloadKey) -> PayloadHeader | None:
        return self._index.get(key)

    def keys(self) -> list[PayloadKey]:
        with self._lock:
            return list(self._index)

    def read_into(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        if key not in self._index:
            return None
        try:
            fd = os.open(self._file(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            with self._host_target(out) as target:
                # One readv fills the header and the destination buffer: no second syscall, no copy.
                head = bytearray(HEADER_BYTES)
                view = host_view(target)
                got = os.readv(fd, [head, view])
                if got < HEADER_BYTES:
                    raise IntegrityError(f"{self.label}: file of {key} is shorter than its header")
                header = PayloadHeader.unpack(head)
                if header.nbytes != view.nbytes:
                    raise IntegrityError(f"{self.label}: file of {key} holds {header.nbytes} bytes, "
                                         f"expected {view.nbytes}")
                got -= HEADER_BYTES
                while got < view.nbytes:
                    n = os.readv(fd, [view[got:]])
                    if not n:
                        raise IntegrityError(f"{self.label}: file of {key} is truncated at {got} bytes")
                    got += n
            return header
        finally:
            os.close(fd)

    def commit_view(self, header: PayloadHeader, data: torch.Tensor,
                    reservation: Reservation | None = None) -> PayloadHandle:
        out = self.commit_views([(header, data, reservation)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def commit_views(self, entries: Sequence[tuple[PayloadHeader, torch.Tensor, Reservation | None]]
                     ) -> list[PayloadHandle | DataPlaneError]:
        """Write many payloads, each to a temporary name renamed into place, in one native call with
        the GIL released (:func:`nexuskv._native.write_payload_files`): one GIL round trip per batch
        instead of four per file (open, writev, close, rename), each a chance for this thread to take
        the GIL from an engine's step thread beside it. Per entry its handle, or the error."""
        out: list[PayloadHandle | DataPlaneError | None] = [None] * len(entries)
        todo: list[int] = []
        with self._lock:
            for i, (header, _data, reservation) in enumerate(entries):
                key = header.key
                if key in self._index or key in self._pending:
                    out[i] = self._handle(self._index.get(key, header))
                    continue
                try:
                    self._admit(key, header.nbytes, reservation)
                except TierFullError as exc:
                    out[i] = exc
                    continue
                self._pending.add(key)
                todo.append(i)
        items, written = [], []
        suffix = f".{os.getpid()}.{threading.get_ident():x}.tmp"
        for i in todo:
            header, data, _ = entries[i]
            path = self._file(header.key)
            try:
                folder = os.path.dirname(path)
                if folder not in self._dirs:
                    os.makedirs(folder, exist_ok=True)
                    self._dirs.add(folder)
                view = host_view(data)
            except (OSError, ValueError) as exc:
                self._unadmit(header)
                out[i] = TierUnavailableError(f"{self.label}: cannot write {header.key}: {exc}")
                continue
            items.append((path + suffix, path, header.pack(), view))
            written.append(i)
        results = self._write_files(items, self.fsync) if items else []
        with self._lock:
            for i, failure in zip(written, results):
                header = entries[i][0]
                self._pending.discard(header.key)
                if failure is None:
                    self._index[header.key] = header
                    out[i] = self._handle(header)
                else:
                    self._used -= header.nbytes
                    out[i] = TierUnavailableError(f"{self.label}: cannot write {header.key}: {failure[1]}")
        return out  # type: ignore[return-value]

    def _unadmit(self, header: PayloadHeader) -> None:
        with self._lock:
            self._used -= header.nbytes
            self._pending.discard(header.key)

    def delete(self, key: PayloadKey) -> bool:
        with self._lock:
            header = self._index.pop(key, None)
            if header is None:
                return False
            self._used -= header.nbytes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._file(key))
        return True


