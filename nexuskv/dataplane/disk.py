"""The local disk tier: one file per payload, a packed header in front of the data.

Layout: ``<root>/<descriptor id>/g<group>/<key as 32 hex digits>.nkv``, each file the 128-byte
:class:`~nexuskv.dataplane.payload.PayloadHeader` followed by the payload bytes. A payload is
written to a temporary name and renamed into place, so a crash never leaves a torn payload
under a real name; a restarted backend rebuilds its index from the headers on disk (payloads
survive the process: ``durable``). Reads use ``readinto`` straight into the destination buffer
(one copy from the page cache); ``fsync=True`` makes commits wait for the device as well.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch

from nexuskv.dataplane.backend import BufferPool, TierBackend, host_view
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.cuda import cuda_available
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHandle, PayloadHeader, PayloadKey
from nexuskv.descriptor import Tier
from nexuskv.errors import IntegrityError, TierUnavailableError

__all__ = ["DiskBackend"]

log = logging.getLogger(__name__)
_SUFFIX = ".nkv"


class DiskBackend(TierBackend):
    """Payload files under ``root``, at most ``capacity_bytes`` of payload data."""

    def __init__(self, root: Path | str, capacity_bytes: int, *, label: str = "disk-files", fsync: bool = False) -> None:
        caps = Capabilities(tier=Tier.DISK, device="cpu", transport="file", durable=True,
                            note="files in the page cache; fsync on commit" if fsync else "files; no fsync on commit")
        super().__init__(label=label, capacity_bytes=capacity_bytes, capabilities=caps)
        self.root = Path(root)
        self.fsync = fsync
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailableError(f"{label}: cannot create {self.root}: {exc}") from None
        self._index: dict[PayloadKey, PayloadHeader] = {}
        self._pending: set[PayloadKey] = set()
        self._dirs: set[Path] = set()
        self._pool = BufferPool(pin=cuda_available(), max_bytes=64 << 20)
        self._scan()

    def path(self, key: PayloadKey) -> Path:
        """The file that holds (or would hold) ``key``."""
        return self.root / key.descriptor_id / f"g{key.group}" / f"{key.key:032x}{_SUFFIX}"

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
        target = out if out.device.type == "cpu" else self._pool.take(out.numel())
        try:
            try:
                fh = open(self.path(key), "rb", buffering=0)  # noqa: SIM115 - closed below
            except FileNotFoundError:
                return None
            with fh:
                header = PayloadHeader.unpack(_read_exact(fh, HEADER_BYTES))
                if header.nbytes != out.numel():
                    raise IntegrityError(f"{self.label}: file of {key} holds {header.nbytes} bytes, "
                                         f"expected {out.numel()}")
                view = host_view(target)
                got = 0
                while got < header.nbytes:
                    n = fh.readinto(view[got:])
                    if not n:
                        raise IntegrityError(f"{self.label}: file of {key} is truncated at {got} bytes")
                    got += n
            if target is not out:
                out.copy_(target)
            return header
        finally:
            if target is not out:
                self._pool.give(target)

    def receive_buffer(self, nbytes: int) -> torch.Tensor:
        return self._pool.take(nbytes)

    def release(self, buf: torch.Tensor) -> None:
        self._pool.give(buf)

    def commit(self, header: PayloadHeader, buf: torch.Tensor) -> PayloadHandle:
        key = header.key
        with self._lock:
            held = key in self._index or key in self._pending
            if not held:
                try:
                    self._admit(key, header.nbytes)
                except BaseException:
                    self.release(buf)
                    raise
                self._pending.add(key)
        if held:
            self.release(buf)
            return self._handle(self._index.get(key, header))
        path = self.path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{id(buf):x}.tmp")
        try:
            if path.parent not in self._dirs:
                path.parent.mkdir(parents=True, exist_ok=True)
                self._dirs.add(path.parent)
            with open(tmp, "wb", buffering=0) as fh:
                fh.write(header.pack())
                view = host_view(buf)
                written = 0
                while written < view.nbytes:
                    written += fh.write(view[written:])
                if self.fsync:
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            with self._lock:
                self._used -= header.nbytes
                self._pending.discard(key)
            raise TierUnavailableError(f"{self.label}: cannot write {key}: {exc}") from None
        finally:
            self.release(buf)
        with self._lock:
            self._index[key] = header
            self._pending.discard(key)
        return self._handle(header)

    def delete(self, key: PayloadKey) -> bool:
        with self._lock:
            header = self._index.pop(key, None)
            if header is None:
                return False
            self._used -= header.nbytes
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()
        return True

    def close(self) -> None:
        self._pool.clear()


def _read_exact(fh, n: int) -> bytes:
    data = fh.read(n)
    if data is None or len(data) != n:
        raise IntegrityError(f"payload file is shorter than its {n}-byte header")
    return data
