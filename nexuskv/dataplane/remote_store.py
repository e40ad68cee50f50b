"""The remote tier's store: Mooncake Store, as NexusKV addresses, names and starts it (torch-free).

The remote tier keeps no payload of its own: payloads live in a Mooncake Store (the
``mooncake-transfer-engine-non-cuda`` wheel from PyPI, which ships its ``mooncake_master`` and
``mooncake_client`` binaries; both need ``libibverbs1`` from Debian, installed by
``infra/store/install.sh``). Two processes make one store:

* ``mooncake_master`` — object metadata, allocation, leases (an object being read cannot be
  removed until its lease ends) and the admin HTTP endpoint (``/metrics``, ``/get_all_keys``,
  ``/health``);
* ``mooncake_client`` (Mooncake's standalone store client) — mounts the memory segment that holds
  the bytes, ``NEXUSKV_REMOTE_TIER_BYTES`` of it, allocated once at start.

A NexusKV process reaches the store at ``mooncake://HOST:RPC_PORT?admin=ADMIN_PORT`` (the master's
RPC port and its admin HTTP port; ``admin`` defaults to Mooncake's 9003). Metadata between
transfer engines is exchanged peer to peer (``P2PHANDSHAKE``): no etcd or metadata server.

This module holds what both sides share and that must not load torch: the address, the object
names of payloads, the admin HTTP client, and the command lines of the two store processes
(started by ``python -m streams.remote_tier``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from nexuskv.dataplane.payload import PayloadKey

__all__ = [
    "ADDRESS_FORM",
    "LEASE_MS",
    "KEY_PREFIX",
    "StoreAddress",
    "parse_store_address",
    "object_name",
    "parse_object_name",
    "StoreAdmin",
    "mooncake_binary",
    "master_argv",
    "segment_argv",
]

ADDRESS_FORM = "mooncake://host:port[?admin=port]"
#: How long a read holds an object against removal (Mooncake's KV lease). A read of a few MiB
#: takes milliseconds; one that outlives its lease is reported by Mooncake and taken as a miss.
LEASE_MS = 1000
#: Every payload object's name starts with this, so the tier can share a store with others.
KEY_PREFIX = "nexuskv/p/"
_DEFAULT_ADMIN = 9003
_NAME = re.compile(r"^nexuskv/p/([0-9]{1,10})/([0-9a-f]{32})/(.+)$", re.S)


@dataclass(frozen=True, slots=True)
class StoreAddress:
    """Where a Mooncake Store's master listens: RPC for the data path, admin HTTP for accounting."""

    host: str
    port: int
    admin_port: int = _DEFAULT_ADMIN

    def __str__(self) -> str:
        return f"mooncake://{self._host()}:{self.port}?admin={self.admin_port}"

    def _host(self) -> str:
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def master(self) -> str:
        """``host:port`` as Mooncake's client takes it."""
        return f"{self._host()}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self._host()}:{self.admin_port}"


def parse_store_address(text: str) -> StoreAddress:
    """``mooncake://host:port[?admin=port]`` to a :class:`StoreAddress`; ValueError naming the form."""
    raw = text.strip()
    if not raw.startswith("mooncake://"):
        raise ValueError(f"remote tier address {text!r}: expected {ADDRESS_FORM}")
    rest, _, query = raw[len("mooncake://"):].partition("?")
    host, sep, port = rest.rstrip("/").rpartition(":")
    host = host.strip("[]")
    admin = str(_DEFAULT_ADMIN)
    if query:
        name, eq, value = query.partition("=")
        if name != "admin" or not eq:
            raise ValueError(f"remote tier address {text!r}: expected {ADDRESS_FORM}")
        admin = value
    for p in (port, admin):
        if not sep or not host or not p.isdigit() or not 0 < int(p) < 65536:
            raise ValueError(f"remote tier address {text!r}: expected {ADDRESS_FORM}")
    return StoreAddress(host, int(port), int(admin))


def object_name(key: PayloadKey) -> str:
    """The store object that holds ``key``'s payload (header first, then the bytes)."""
    return f"{KEY_PREFIX}{key.group}/{key.key:032x}/{key.descriptor_id}"


def parse_object_name(name: str) -> PayloadKey | None:
    """The payload key an object name stands for; None for a name NexusKV would never write."""
    m = _NAME.match(name)
    if m is None:
        return None
    try:
        return PayloadKey(m.group(3), int(m.group(2), 16), int(m.group(1)))
    except ValueError:  # a descriptor id that is empty, too long or not ASCII
        return None


class StoreAdmin:
    """The master's admin HTTP endpoint, every call bounded by ``timeout_s``.

    Raises OSError (``urllib.error.URLError`` included) when it cannot be reached or answers
    something else than expected; callers turn that into TierUnavailableError.
    """

    def __init__(self, address: StoreAddress, *, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.address.admin_url + path, timeout=self.timeout_s) as resp:
            return resp.read()

    def healthy(self) -> bool:
        try:
            doc = json.loads(self._get("/health"))
        except (OSError, ValueError):
            return False
        return bool(doc.get("service_ready")) and doc.get("status") == "ok"

    def capacity(self) -> tuple[int, int]:
        """(bytes of mounted memory segments, bytes allocated to objects), from ``/metrics``."""
        total = used = None
        for line in self._get("/metrics").decode("utf-8", "replace").splitlines():
            if line.startswith("master_total_capacity_bytes "):
                total = int(float(line.split()[1]))
            elif line.startswith("master_allocated_bytes "):
                used = int(float(line.split()[1]))
        if total is None or used is None:
            raise OSError(f"{self.address.admin_url}/metrics lacks the master's capacity gauges")
        return total, used

    def object_names(self) -> list[str]:
        """Every object name the master holds (one per line in ``/get_all_keys``)."""
        text = self._get("/get_all_keys").decode("utf-8", "replace")
        return [n for n in text.split("\n") if n]


def reachable(address: StoreAddress, timeout_s: float) -> bool:
    """Whether the master's RPC port accepts a connection within ``timeout_s``."""
    try:
        socket.create_connection((address.host, address.port), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def local_host_for(address: StoreAddress, timeout_s: float) -> str:
    """The address of this host that the store sees (the one a connection to the master leaves from)."""
    with socket.create_connection((address.host, address.port), timeout=timeout_s) as s:
        return s.getsockname()[0]


def mooncake_binary(name: str) -> Path:
    """Path of a binary shipped in the Mooncake wheel; FileNotFoundError naming the install step."""
    spec = importlib.util.find_spec("mooncake")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"{name} not found: the remote tier needs Mooncake Store "
                            "(pip package mooncake-transfer-engine-non-cuda, installed with NexusKV; "
                            "and libibverbs1: bash infra/store/install.sh)")


def master_argv(address: StoreAddress, *, bind_host: str, rpc_threads: int = 4) -> list[str]:
    """``mooncake_master`` serving ``address``: no eviction of its own, bounded RPC threads,
    idle connections closed after 60 s, a :data:`LEASE_MS` lease on every read."""
    return [str(mooncake_binary("mooncake_master")),
            f"--rpc_port={address.port}", f"--rpc_address={bind_host}",
            f"--metrics_port={address.admin_port}", f"--metrics_host={bind_host}",
            f"--rpc_thread_num={rpc_threads}", "--rpc_conn_timeout_seconds=60",
            f"--default_kv_lease_ttl={LEASE_MS}",
            # A full store rejects a put (NexusKV pins every object): the index is never made
            # wrong behind its back by an eviction it did not decide.
            "--eviction_high_watermark_ratio=1.0", "--enable_http_metadata_server=false",
            "--enable_metric_reporting=false", "--logtostderr=true"]


def segment_argv(address: StoreAddress, *, capacity_bytes: int, host: str, port: int) -> list[str]:
    """``mooncake_client`` mounting ``capacity_bytes`` of memory into the store at ``address``."""
    return [str(mooncake_binary("mooncake_client")),
            f"--master_server_address={address.master}", "--metadata_server=P2PHANDSHAKE",
            f"--global_segment_size={capacity_bytes}", "--local_buffer_size=0",
            f"--host={host}", f"--port={port}", "--protocol=tcp", "--threads=1", "--logtostderr=true"]
