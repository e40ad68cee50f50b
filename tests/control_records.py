"""Control records as the planner, an executor or an attacker sends them: placement hints,
transfer commands, and the exact signed (or unsigned) record a producer puts on a control topic.
One copy, shared by the control-topic tests and ``benchmarks/attack_control_records.py``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable

from nexuskv.contracts import codec
from nexuskv.contracts.control_signature import producer_key
from nexuskv.contracts.placement import HintKind, PlacementHint
from nexuskv.contracts.transfers import TransferCommand
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from streams.bus.clients import ControlSigner, record_headers

from tests.dataplane.tiering import BLOCK_BYTES

Record = tuple[str, bytes, bytes, list[tuple[str, bytes]] | None]


def signer(producer: str, secret: bytes, clock: Callable[[], float] = time.time) -> ControlSigner:
    """``producer``'s signer under bus secret ``secret`` (another secret: a forger's)."""
    return ControlSigner(producer, key=producer_key(secret, producer), clock=clock)


def record(topic, key: str, value, signer: ControlSigner | None) -> Record:
    """The exact record a producer sends (so that it can be sent again byte for byte)."""
    raw_key, payload = key.encode(), codec.encode(topic, value)
    return topic.name, raw_key, payload, record_headers(raw_key, payload, value, None, None, topic=topic,
                                                        control=signer)


async def send(producer, records: Iterable[Record]) -> None:
    for topic, key, payload, headers in records:
        await producer.send_and_wait(topic, payload, key=key, headers=headers or None)


def hint(kind: HintKind, worker: str, *, keys=(), tier=Tier.HOST, transfer_id=None, expires_at=None, nbytes=0,
         to_tier=None, tenant="acme", reason="test") -> PlacementHint:
    return PlacementHint(hint_id=f"h-{uuid.uuid4().hex[:8]}", tenant_namespace=tenant, kind=kind, worker=worker,
                         tier=tier, keys=tuple(k.key for k in keys), descriptor_id="tiny-desc" if keys else None,
                         blocks=len(keys), bytes=nbytes, transfer_id=transfer_id, expires_at=expires_at,
                         to_tier=to_tier, issued_at=time.time(), reason=reason)


def command(tid: str, worker: str, keys, src: Tier = Tier.HOST, dst: Tier = Tier.GPU,
            deadline_in: float = 30.0) -> TransferCommand:
    now = time.time()
    return TransferCommand(transfer_id=tid, request_id=f"r-{tid}", descriptor_id="tiny-desc", tenant_namespace="acme",
                           keys=tuple(k.key for k in keys), source=EntryLocation(worker=worker, tier=src),
                           destination=EntryLocation(worker=worker, tier=dst), bytes=len(keys) * BLOCK_BYTES,
                           issued_at=now, deadline_at=now + deadline_in)
