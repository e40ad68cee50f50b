"""The remote tier as a backend: payloads in a Mooncake Store, with NexusKV's checks on top.

The store (:mod:`nexuskv.dataplane.remote_store`; ``python -m streams.remote_tier`` starts one for
``nexuskv up`` and for the tests) is reached at ``mooncake://host:port?admin=port`` through
Mooncake's own Python client over its TCP transport, so the tier is ``out_of_process`` and
``shared``: every worker that can reach the address reads what any of them saved.

Each payload is one store object named by its address (:func:`~nexuskv.dataplane.remote_store.object_name`)
holding the packed 128-byte :class:`~nexuskv.dataplane.payload.PayloadHeader` and then the bytes,
written and read in one call from and into the caller's buffers (no staging copy). The store is
not trusted with integrity:

* a save is verified against its header before it is sent (a corrupt payload is refused here,
  nothing is stored);
* a read checks that the header it got back names the requested payload and size, and the reader
  verifies the checksum over address and bytes, so a read never yields another payload's bytes
  under a valid header; a missing, torn or relabelled object is a miss (None, or IntegrityError
  for a reader told it is there), which falls back to recompute.

**A save is acknowledged only when a read would return its bytes.** Mooncake keeps the first
object put under a name and answers a second put with success; anyone who can reach the store can
create an object under a payload's name first. So a put's success is not taken on trust: a name
already held is read back whole and verified (its header must name the payload with the same
checksum, and its bytes must pass it), and after a put the stored header is read back and
compared. A copy that verifies is the same payload — saved by another
worker — and the save succeeds; anything else fails the save with
:class:`~nexuskv.errors.ObjectConflictError` naming what the store holds, is counted
(``conflicts``), and nothing is announced.

**Every call has a deadline that holds.** Mooncake's client blocks in C++ for as long as its own
timeouts say (a put took 65 s against a 10 s budget while 600 connections flooded the store's
transfer port). Every call (setup, put, get, exists, remove, the header reads) runs on the
backend's :class:`~nexuskv.dataplane.deadlines.DeadlineCalls` and is awaited at most
``timeout_s``; an overrun is TierUnavailableError (counted: ``overruns``), and the abandoned
call's buffers — private staging buffers, never the caller's tensors — are given back only once
Mooncake returns, so a late read can never write into memory its caller reuses, and a late write
sends the bytes that were verified.

**Deletes are not starved.** Mooncake gives every read a lease
(:data:`~nexuskv.dataplane.remote_store.LEASE_MS`) during which the object cannot be removed, so a
DELETE racing a GET waits for the read instead of freeing its bytes under it. Readers that never
stop would hold a name for ever: :meth:`RemoteBackend.delete` retries with backoff for at most
``delete_wait_s`` (``delete_retries``), then removes the object regardless of its lease
(``forced_deletes``). That is safe because no read is trusted: a read racing a forced removal gets
the old bytes whole, or fails its header and checksum checks and is a miss (recompute).

Every object is hard-pinned: the store never evicts on its own, and a full store rejects the save
(TierFullError) with nothing stored, so the index is never made wrong by an eviction NexusKV did
not decide. Capacity and use are the store's own (its admin endpoint's gauges), headers included:
a payload of ``n`` bytes uses ``n + 128``. The admin endpoint is called with ``timeout_s``; one
client (a fixed set of Mooncake threads) per backend, shared by every thread.

**A store that is gone costs one deadline, not one per call.** A call that overran or got a
Mooncake transport error opens the store's :class:`~nexuskv.dataplane.deadlines.Breaker` (one per
store address in a process, shared by its backends): until
the store's master accepts connections again, calls fail at once (TierUnavailableError, counted
``short_circuited``), so the engine's probes and loads recompute and its saves are dropped
without waiting; the first call that succeeds closes it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import numpy as np
import torch

from nexuskv.dataplane.backend import Reservation, StagedBackend, host_view
from nexuskv.dataplane.capabilities import Capabilities
from nexuskv.dataplane.cuda import cuda_available
from nexuskv.dataplane.deadlines import Breaker, DeadlineCalls
from nexuskv.dataplane.payload import HEADER_BYTES, PayloadHandle, PayloadHeader, PayloadKey, verify_payload
from nexuskv.dataplane.remote_store import (
    KEY_PREFIX,
    StoreAddress,
    StoreAdmin,
    local_host_for,
    object_name,
    parse_object_name,
    parse_store_address,
    reachable,
)
from nexuskv.descriptor import Tier
from nexuskv.errors import IntegrityError, ObjectConflictError, TierFullError, TierUnavailableError

__all__ = ["RemoteBackend"]

log = logging.getLogger(__name__)

_HEADS_PER_CALL = 4096
# Mooncake's error codes (mooncake-store/include/types.h) that NexusKV tells apart.
_NO_AVAILABLE_HANDLE = -200  # no room: a full store
_INVALID_PARAMS = -600  # e.g. a read whose buffers do not add up to the object's size
_OBJECT_NOT_FOUND = -704
_OBJECT_ALREADY_EXISTS = -705
_BUSY = (-703, -706, -714)  # replica not ready (a put in progress), lease held, replica in use
_LEASE_EXPIRED = -707
_RPC_FAIL = -900  # the master or a segment did not answer


def _mooncake():
    # Mooncake's C++ logging (glog) writes INFO lines for every client set-up; warnings and errors stay.
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    try:
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    except ImportError as exc:  # the wheel, or libibverbs1 it links, is missing
        raise TierUnavailableError(f"the Mooncake Store client cannot be loaded ({exc}); install it with "
                                   "`bash infra/store/install.sh && python -m pip install -e .`") from None
    return MooncakeDistributedStore, ReplicateConfig


_breakers: dict[StoreAddress, Breaker] = {}
_breakers_lock = threading.Lock()


def _breaker_for(address: StoreAddress) -> Breaker:
    """One breaker per store in a process: the scheduler's probes and the worker's loads and saves
    are separate backends of one engine, and a store one of them found down is down for all."""
    with _breakers_lock:
        b = _breakers.get(address)
        if b is None:
            b = _breakers[address] = Breaker(f"remote tier {address}", alive=lambda: reachable(address, 0.5))
        return b


class RemoteBackend(StagedBackend):
    """A client of the Mooncake Store at ``address``; capacity is the store's."""

    #: commit_view hashes the bytes against their header before it sends them (the store does not).
    verifies_on_commit = True

    @classmethod
    def connect(cls, address: str, *, wait_s: float, label: str = "remote-mooncake") -> RemoteBackend:
        """A backend for the store at ``address``, retrying for up to ``wait_s`` while it starts."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return cls(address, label=label)
            except TierUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def __init__(self, address: str, *, label: str = "remote-mooncake", timeout_s: float = 10.0,
                 delete_wait_s: float = 2.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.delete_wait_s = delete_wait_s
        self.conflicts = 0  # saves refused: the store held another object under the payload's name
        self.delete_retries = 0  # removals tried again while a read's lease held the object
        self.forced_deletes = 0  # removals that went ahead of readers after delete_wait_s
        try:
            self._addr: StoreAddress = parse_store_address(address)
        except ValueError as exc:
            raise TierUnavailableError(str(exc)) from None
        if not reachable(self._addr, min(timeout_s, 5.0)):
            raise TierUnavailableError(f"remote tier {address} cannot be reached (no Mooncake master at "
                                       f"{self._addr.master})")
        self._admin = StoreAdmin(self._addr, timeout_s=timeout_s)
        capacity, _ = self._capacity()
        if capacity <= 0:
            raise TierUnavailableError(f"remote tier {address}: the store has no memory segment mounted")
        store_cls, config_cls = _mooncake()
        self._breaker = _breaker_for(self._addr)
        self._calls = DeadlineCalls(f"remote tier {address}", threads=4, max_outstanding=64)
        self._store = store_cls()
        local = local_host_for(self._addr, timeout_s)
        try:
            rc = self._calls.call("client setup", lambda: self._store.setup(local, "P2PHANDSHAKE", 0, 0, "tcp", "",
                                                                            self._addr.master),
                                  deadline_s=timeout_s)
        except TierUnavailableError:
            self._calls.close()
            raise
        if rc != 0:
            raise TierUnavailableError(f"remote tier {address}: the Mooncake client could not join the store "
                                       f"(setup returned {rc})")
        self._pin = config_cls()
        self._pin.with_hard_pin = True  # only NexusKV evicts NexusKV's payloads
        # Headers are read into registered buffers, many per call (Mooncake reads byte ranges only
        # into registered memory); a buffer an abandoned call still writes into is not reused.
        self._heads_free: list[np.ndarray] = []
        self._heads_lock = threading.Lock()
        self._closed = False
        try:
            self._give_heads(self._take_heads())
        except TierUnavailableError:
            self._store.close()
            self._calls.close()
            raise
        caps = Capabilities(tier=Tier.REMOTE, device="cpu", transport="tcp", out_of_process=True, shared=True,
                            note=f"payloads held by the Mooncake Store at {address}")
        super().__init__(label=label, capacity_bytes=capacity, capabilities=caps, pin=cuda_available())

    # -- accounting lives in the store --------------------------------------------------------

    def _capacity(self) -> tuple[int, int]:
        try:
            return self._admin.capacity()
        except OSError as exc:
            raise TierUnavailableError(f"remote tier {self.address}: admin endpoint {self._addr.admin_url} "
                                       f"cannot be reached: {exc}") from None

    def stats(self) -> dict[str, int]:
        capacity, used = self._capacity()
        return {"capacity_bytes": capacity, "used_bytes": used}

    def used_bytes(self) -> int:
        """Bytes the store has allocated: every payload with its 128-byte header."""
        return self._capacity()[1]

    def free_bytes(self) -> int:
        capacity, used = self._capacity()
        return capacity - used

    def ping(self) -> bool:
        return self._admin.healthy()

    def reserve(self, nbytes: int) -> Reservation | None:
        """Not binding: the store is shared by every worker and admits each save on its own, so
        this only checks the room it has now (a transfer can still be rejected midway, and is
        then rolled back)."""
        return Reservation(self, 0) if self.free_bytes() >= nbytes else None

    # -- the interface ----------------------------------------------------------------------

    def header(self, key: PayloadKey) -> PayloadHeader | None:
        return self.headers([key])[0]

    def headers(self, keys: Sequence[PayloadKey], *, deadline_s: float | None = None) -> list[PayloadHeader | None]:
        """The stored headers of ``keys`` (None: not held), each call within ``deadline_s`` (default
        ``timeout_s``; an engine's scheduler thread asks with a shorter one)."""
        out: list[PayloadHeader | None] = []
        for start in range(0, len(keys), _HEADS_PER_CALL):
            chunk = list(keys[start:start + _HEADS_PER_CALL])
            names = [object_name(k) for k in chunk]
            heads = self._take_heads(deadline_s)
            codes = self._call(
                f"reading {len(chunk)} headers",
                lambda: self._store.get_into_ranges([heads.ctypes.data], [names],
                                                    [[[i * HEADER_BYTES] for i in range(len(chunk))]],
                                                    [[[0]] * len(chunk)], [[[HEADER_BYTES]] * len(chunk)]),
                on_late=lambda: self._give_heads(heads), deadline_s=deadline_s)
            raw = heads[:len(chunk) * HEADER_BYTES].tobytes()
            self._give_heads(heads)
            for i, (key, code) in enumerate(zip(chunk, codes[0])):
                got = code[0]
                if got == HEADER_BYTES:
                    out.append(self._checked_header(key, raw[i * HEADER_BYTES:(i + 1) * HEADER_BYTES]))
                elif got in (_OBJECT_NOT_FOUND, _LEASE_EXPIRED, _INVALID_PARAMS) or got in _BUSY:
                    # A miss; busy: another writer's put of that object is in progress (two engines'
                    # start-up probes of one key). Neither says the store is down: no breaker.
                    out.append(None)
                else:
                    raise self._transport_failed(f"remote tier {self.address}: reading the header of {key} "
                                                 f"failed (Mooncake error {got})")
        return out

    def _take_heads(self, deadline_s: float | None = None) -> np.ndarray:
        with self._heads_lock:
            if self._heads_free:
                return self._heads_free.pop()
        heads = np.zeros(_HEADS_PER_CALL * HEADER_BYTES, dtype=np.uint8)
        rc = self._call("registering a header buffer",
                        lambda: self._store.register_buffer(heads.ctypes.data, heads.nbytes), deadline_s=deadline_s)
        if rc != 0:
            raise TierUnavailableError(f"remote tier {self.address}: cannot register a header buffer ({rc})")
        return heads

    def _give_heads(self, heads: np.ndarray) -> None:
        with self._heads_lock:
            if len(self._heads_free) < 4:  # more only exist while calls that overran still hold them
                self._heads_free.append(heads)
                return
        try:
            self._call("unregistering a header buffer", lambda: self._store.unregister_buffer(heads.ctypes.data))
        except TierUnavailableError as exc:  # the buffer stays registered: a few hundred KiB
            log.warning("remote tier: %s", exc)

    def _call(self, what: str, fn, *, on_late=None, deadline_s: float | None = None):
        """``fn()`` on the backend's Mooncake threads, within ``deadline_s`` (default ``timeout_s``;
        TierUnavailableError past it, or at once while the store is known down)."""
        self._breaker.check(what)
        try:
            result = self._calls.call(what, fn, deadline_s=self.timeout_s if deadline_s is None else deadline_s,
                                      on_late=on_late)
        except TierUnavailableError as exc:
            self._breaker.failed(str(exc))
            raise
        self._breaker.succeeded()
        return result

    def _transport_failed(self, message: str) -> TierUnavailableError:
        """A Mooncake error that says the store did not answer: the breaker opens; raise the result."""
        self._breaker.failed(message)
        return TierUnavailableError(message)

    def _checked_header(self, key: PayloadKey, raw: bytes) -> PayloadHeader | None:
        """The stored header when it names ``key``; None (a miss, logged) when it is not a header of it."""
        try:
            header = PayloadHeader.unpack(raw)
        except IntegrityError as exc:
            log.warning("remote tier: object of %s has no valid header (%s); treated as a miss", key, exc)
            return None
        if header.key != key:
            log.warning("remote tier: object of %s holds a header of %s; treated as a miss", key, header.key)
            return None
        return header

    def keys(self) -> list[PayloadKey]:
        """Every NexusKV payload the store holds; objects under NexusKV's prefix whose names are not
        a payload's (another client's, a malformed descriptor id) are left out, with a warning."""
        try:
            names = self._admin.object_names()
        except OSError as exc:
            raise TierUnavailableError(f"remote tier {self.address}: cannot list objects: {exc}") from None
        named: list[tuple[str, PayloadKey]] = []
        foreign = 0
        for name in names:
            if not name.startswith(KEY_PREFIX):
                continue
            key = parse_object_name(name)
            if key is None or object_name(key) != name:
                foreign += 1
            else:
                named.append((name, key))
        # The listing is one name per line: a name with a line break in it could pose as another.
        held = self._call(f"checking {len(named)} objects",
                          lambda: self._store.batch_is_exist([name for name, _ in named])) if named else []
        keys = [key for (_, key), there in zip(named, held) if there == 1]
        foreign += len(named) - len(keys)
        if foreign:
            log.warning("remote tier: %d objects under %s are not named like NexusKV payloads; ignored",
                        foreign, KEY_PREFIX)
        return keys

    def read_into(self, key: PayloadKey, out: torch.Tensor) -> PayloadHeader | None:
        n = out.numel()
        if out.dtype is not torch.uint8 or not out.is_contiguous():
            raise ValueError(f"read_into {key}: needs a contiguous uint8 buffer, got {out.dtype}")
        header = self._get(key, n)
        if header is None:
            return None
        head, staged = header
        try:
            out.copy_(staged)
        finally:
            self._pool.give(staged)
        return head

    def _get(self, key: PayloadKey, n: int) -> tuple[PayloadHeader, torch.Tensor] | None:
        """The object of ``key`` as ``n`` bytes read into a private staging buffer (the caller gives it
        back), with its header checked; None when the store does not hold it."""
        name = object_name(key)
        head = np.zeros(HEADER_BYTES, dtype=np.uint8)
        staged = self._pool.take(n)

        def give_back() -> None:
            self._pool.give(staged)

        try:
            got = self._call(f"GET {key}", lambda: self._store.batch_get_into_multi_buffers(
                [name], [[head.ctypes.data, staged.data_ptr()]], [[HEADER_BYTES, n]])[0], on_late=give_back)
        except TierUnavailableError:
            raise  # an overrun: the staging buffer stays with the abandoned call (given back when it returns)
        except BaseException:
            give_back()
            raise
        try:
            if got == _OBJECT_NOT_FOUND:
                give_back()
                return None
            if got == _INVALID_PARAMS:
                raise IntegrityError(f"{key}: the stored object is not a {n}-byte payload with its header")
            if got == _LEASE_EXPIRED:
                raise IntegrityError(f"{key}: the read outlived its lease; its bytes may be torn")
            if got == _RPC_FAIL:
                raise self._transport_failed(f"remote tier {self.address}: GET {key} failed (Mooncake error {got})")
            if got != HEADER_BYTES + n:
                size = self._call(f"sizing {key}", lambda: self._store.get_size(name))
                if size not in (HEADER_BYTES + n, _OBJECT_NOT_FOUND):
                    raise IntegrityError(f"{key}: the stored object is not a {n}-byte payload with its header")
                raise TierUnavailableError(f"remote tier {self.address}: GET {key} failed (Mooncake error {got})")
            header = PayloadHeader.unpack(head.tobytes())
            if header.key != key or header.nbytes != n:
                raise IntegrityError(f"payload header names {header.key} ({header.nbytes} bytes), not {key} "
                                     f"({n} bytes)")
        except BaseException:
            give_back()
            raise
        return header, staged

    def commit_view(self, header: PayloadHeader, data: torch.Tensor,
                    reservation: Reservation | None = None) -> PayloadHandle:
        if data.device.type != "cpu":
            raise ValueError(f"{self.label}: commit_view needs a host tensor, got one on {data.device}")
        data = data.reshape(-1).contiguous()
        if data.dtype is not torch.uint8:
            data = data.view(torch.uint8)
        # The bytes sent are a private copy of the verified ones: a put that overruns its deadline
        # may still read them after the caller has reused ``data``.
        staged = self._pool.take(header.nbytes)
        staged.copy_(data)
        try:
            verify_payload(header.key, header, host_view(staged))  # IntegrityError: nothing is sent
        except BaseException:
            self._pool.give(staged)
            raise
        name = object_name(header.key)
        # Mooncake answers a put under a name it already holds with success and keeps the first
        # object, so whatever is there is checked instead of trusted: read back whole when the
        # name was taken before the put, by its header after it (a squatter racing in between is
        # caught unless it wrote this payload's exact header, which names a checksum it could not
        # know without the bytes; even then its object is a miss for every reader, never data).
        held = self._call(f"EXISTS {header.key}", lambda: self._store.is_exist(name))
        if held == 1:
            self._pool.give(staged)
            self._check_existing(header)  # ObjectConflictError unless it is this very payload
            return self._handle(header)
        head = np.frombuffer(header.pack(), dtype=np.uint8)

        def give_back() -> None:
            self._pool.give(staged)

        rc = self._call(f"PUT {header.key}", lambda: self._store.batch_put_from_multi_buffers(
            [name], [[head.ctypes.data, staged.data_ptr()]], [[HEADER_BYTES, header.nbytes]], self._pin)[0],
            on_late=give_back)
        give_back()
        if rc in (0, _OBJECT_ALREADY_EXISTS):
            stored = self.header(header.key)
            if stored is None or stored.checksum != header.checksum or stored.nbytes != header.nbytes:
                self._check_existing(header)
            return self._handle(header)
        if rc == _NO_AVAILABLE_HANDLE:
            capacity, used = self._capacity()
            raise TierFullError(f"{self.label}: remote tier full: {header.nbytes} bytes for {header.key} do not fit "
                                f"({capacity - used} of {capacity} free)")
        message = f"{self.label}: PUT {header.key} failed (Mooncake error {rc})"
        raise self._transport_failed(message) if rc == _RPC_FAIL else TierUnavailableError(message)

    def _check_existing(self, header: PayloadHeader) -> None:
        """The store already holds an object under ``header``'s name: acknowledge the save only if
        that object reads back as this payload (another worker saved the same bytes); otherwise
        the name is squatted or stale and the save fails, naming what is there."""
        try:
            got = self._get(header.key, header.nbytes)
        except IntegrityError as exc:
            got, why = None, str(exc)
        else:
            why = "it disappeared before it could be read back" if got is None else ""
        if got is not None:
            stored, staged = got
            try:
                if stored.checksum == header.checksum:
                    verify_payload(header.key, stored, host_view(staged))
                    return
                why = "it holds another payload under the same name (a different checksum)"
            except IntegrityError as exc:
                why = f"its bytes fail their checksum ({exc})"
            finally:
                self._pool.give(staged)
        self.conflicts += 1
        raise ObjectConflictError(f"{self.label}: {header.key} was not saved: the store already holds an object "
                                  f"under its name that is not this payload: {why}")

    def delete(self, key: PayloadKey) -> bool:
        """Remove a payload (True) or find it gone (False). While a read's lease holds it, retry with
        backoff for at most ``delete_wait_s``, then remove it regardless (readers of it then miss)."""
        name = object_name(key)
        deadline = time.monotonic() + self.delete_wait_s
        pause = 0.01
        while True:
            rc = self._call(f"DELETE {key}", lambda: self._store.remove(name))
            if rc == 0:
                return True
            if rc == _OBJECT_NOT_FOUND:
                return False
            if rc not in _BUSY:
                raise TierUnavailableError(f"remote tier {self.address}: DELETE {key} failed (Mooncake error {rc})")
            if time.monotonic() + pause > deadline:
                break
            self.delete_retries += 1
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
        rc = self._call(f"DELETE {key} (forced)", lambda: self._store.remove(name, True))
        if rc in (0, _OBJECT_NOT_FOUND):
            self.forced_deletes += 1
            log.info("remote tier: %s removed ahead of its readers after %.1fs of leases", key, self.delete_wait_s)
            return rc == 0
        raise TierUnavailableError(f"remote tier {self.address}: DELETE {key} failed (Mooncake error {rc})")

    def clear(self) -> None:
        """Drop every NexusKV payload in the store at once, reads in progress or not (they fail
        their checks rather than see other bytes)."""
        rc = self._call("clear", lambda: self._store.remove_by_regex(f"^{KEY_PREFIX}", True))
        if rc < 0:
            raise TierUnavailableError(f"remote tier {self.address}: clear failed (Mooncake error {rc})")

    def counters(self) -> dict[str, int]:
        """What the backend refused or waited out: conflicts, deadline overruns, delete retries."""
        calls = self._calls
        return {"conflicts": self.conflicts, "overruns": calls.overruns, "refused_calls": calls.refused,
                "late_returns": calls.late, "delete_retries": self.delete_retries,
                "forced_deletes": self.forced_deletes, "short_circuited": self._breaker.short_circuited,
                "store_down": self._breaker.opened}

    def close(self) -> None:
        if not getattr(self, "_closed", True):
            self._closed = True
            try:
                self._call("close", self._store.close)
            except TierUnavailableError as exc:
                log.warning("remote tier: %s", exc)
            self._calls.close()
        super().close()
