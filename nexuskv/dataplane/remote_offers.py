"""A writer's side of the shared remote tier: put the bytes, then offer them to the tier's owner.

A worker never announces remote-tier blocks itself, and never evicts there: it writes each
block's object (the backend verifies what it sends and acknowledges only what reads back) and
builds one :class:`~nexuskv.contracts.tier_offers.TierOffer` of what it wrote, which the caller
sends on ``nexuskv.tier-offers`` (:func:`streams.bus.topic_keys.route` keys it by writer), signed
as a control record of producer ``writer/<worker>`` (``streams.bus.clients.ControlSigner``; the
owner refuses an unsigned offer under a bus secret). The
remote-tier manager then admits or refuses each block (:mod:`nexuskv.dataplane.remote_ledger`).

Blocks are written in chain order and the offer stops at the first block that could not be
written: the blocks after it could not be keyed without it. A block whose object the store
already holds under this payload's header (same size and checksum: another writer saved the same
bytes, or the owner kept an earlier save) is offered without being written again: a put of a
held name reads the whole object back to verify it, and the owner checks the header either way
(a torn object under a valid header is a miss for every reader, which recomputes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.tier_offers import MAX_OFFERED_BLOCKS, OfferedBlock, TierOffer
from nexuskv.dataplane.backend import TierBackend, host_view
from nexuskv.dataplane.payload import PayloadHeader
from nexuskv.dataplane.tiers import SaveBlock
from nexuskv.errors import DataPlaneError

__all__ = ["RemoteSave", "save_and_offer"]


@dataclass(frozen=True, slots=True)
class RemoteSave:
    """What a writer put in the remote tier (``written``; ``already`` there), and the offers to send
    for it (empty: nothing to offer)."""

    written: int
    failed: int
    nbytes: int
    offers: tuple[TierOffer, ...] = ()
    reasons: tuple[str, ...] = ()
    already: int = 0  # offered without a write: the store held the same payload


def save_and_offer(backend: TierBackend, blocks: Sequence[SaveBlock], *, writer: str, tenant: str,
                   identity: PublisherIdentity, block_size: int, offer_id: str, now: float) -> RemoteSave:
    """Put ``blocks`` (in chain order, each with its identity) in the remote ``backend``; the offers of
    what was written, in order, at most :data:`MAX_OFFERED_BLOCKS` blocks each."""
    offered: list[OfferedBlock] = []
    reasons: list[str] = []
    failed = nbytes = already = 0
    try:
        held = backend.headers([sb.key for sb in blocks])
    except DataPlaneError:
        held = [None] * len(blocks)  # unknown: every block is put (and verified there)
    for i, (sb, there) in enumerate(zip(blocks, held)):
        if sb.identity is None:
            raise ValueError(f"block {sb.key}: a remote-tier save needs the block's identity")
        data = sb.data.reshape(-1).view(torch.uint8)
        header = PayloadHeader.for_data(sb.key, host_view(data))
        if there is not None and there.nbytes == header.nbytes and there.checksum == header.checksum:
            already += 1
        else:
            try:
                backend.put(header, data)
            except (DataPlaneError, ValueError) as exc:  # full, unreachable, a conflicting object: not offered
                failed = len(blocks) - i
                reasons.append(f"block {sb.key}: {type(exc).__name__}: {exc}")
                break
            nbytes += header.nbytes
        offered.append(OfferedBlock(key=sb.key.key, parent=sb.identity.parent, nbytes=header.nbytes,
                                    checksum=header.checksum, position=sb.position if sb.position is not None else i))
    offers = []
    first = blocks[0] if blocks else None
    for n, start in enumerate(range(0, len(offered), MAX_OFFERED_BLOCKS)):
        assert first is not None
        ident = first.identity
        offers.append(TierOffer(
            offer_id=f"{offer_id}/{n}" if len(offered) > MAX_OFFERED_BLOCKS else offer_id, writer=writer,
            tenant_namespace=tenant, identity=identity, descriptor_id=first.key.descriptor_id, group=first.key.group,
            block_size=block_size, lora=ident.lora if ident else None, cache_salt=ident.cache_salt if ident else None,
            blocks=tuple(offered[start:start + MAX_OFFERED_BLOCKS]), offered_at=now))
    return RemoteSave(len(offered) - already, failed, nbytes, tuple(offers), tuple(reasons), already)
