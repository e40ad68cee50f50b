"""Remote tier with and without its owner: failed saves and new-prefix hits once the store fills.

What runs, all real: one Mooncake Store (``python -m streams.remote_tier``, ``--store-mib`` of
memory), a writer that saves each prompt's blocks to it, and a reader that prefetches each new
prefix back a few prompts later (``--lag``) — what another worker does when the planner moves state
through the shared tier — plus one hot prefix every prompt carries. Two arms over the same prompts,
against the same store (emptied between arms), in alternating order across ``--runs`` repeats:

* **unmanaged** (before: every tier manager passed the shared tier through): the writer puts
  each block; nothing evicts, so once the store is full every put fails (``TierFullError``) and
  the prefetches of new prefixes miss;
* **owner**: the writer puts and offers (:func:`nexuskv.dataplane.remote_offers.save_and_offer`);
  the remote-tier manager's owner (:class:`streams.remote_tier_manager.RemoteTierOwner` over a
  :class:`~nexuskv.dataplane.remote_ledger.RemoteLedger`, default watermarks) decides each offer,
  sees each prefetch as a transfer reading the tier (kept while it reads, a use), keeps headroom
  after every prompt (the service does it every ``NEXUSKV_TIER_STATE_INTERVAL``) and sweeps every
  20 prompts. Its reuse half-life (``--half-life``, 5 s) is about the time within which state is
  reused here (a prefix is read ``--lag`` prompts after its save), as ``soak_tiers`` sets it;
* **owner-600s**: the same with the default ``NEXUSKV_TIER_REUSE_HALF_LIFE`` of 600 s (in the
  details only): a prefix read once outranks every newer one that has not been read yet for
  minutes, so the owner keeps the old and evicts the new.

A prefetch is a hit when every block of the prefix reads back verified. ``blocks_saved`` counts
successful puts (the unmanaged writer re-puts the hot prefix each time; the owner arm's writer
skips what the store holds under the same header). Figures (medians of the
per-run ratios, owner over unmanaged): the share of new-prefix prefetches that hit
(``remote_owner_hits``) and the failed block saves (``remote_owner_failed_saves``). The owner is
called in process: the bus between writer and owner (``nexuskv.tier-offers``, Kafka) is not in
this measurement (``tests/streams/test_remote_tier_manager.py`` runs it on Apache Kafka).

``python -m benchmarks.remote_owner`` writes both files under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import torch

from nexuskv.config import Settings
from nexuskv.contracts.kv_events import PublisherIdentity
from nexuskv.contracts.transfers import TransferCommand, TransferResult, TransferStatus
from nexuskv.cost import extent_bytes
from nexuskv.dataplane.backend import host_view
from nexuskv.dataplane.payload import PayloadHeader, PayloadKey
from nexuskv.dataplane.remote import RemoteBackend
from nexuskv.dataplane.remote_offers import save_and_offer
from nexuskv.dataplane.tier_facts import BlockIdentity, TierFacts
from nexuskv.dataplane.tiers import SaveBlock
from nexuskv.descriptor import Tier
from nexuskv.entries import EntryLocation
from nexuskv.errors import DataPlaneError
from nexuskv.identity import BlockKeyer, IdentityScope
from nexuskv.models import known_model
from streams.remote_tier_manager import RemoteTierOwner, build

from benchmarks._result import Run, write_result

__all__ = ["ArmResult", "main", "run_arm"]

TENANT = "bench"
OWNER = "remote-tier"


@dataclass(frozen=True, slots=True)
class ArmResult:
    arm: str
    prompts: int
    blocks_saved: int
    failed_saves: int
    prefetches: int
    new_prefix_hits: int
    hot_hits: int
    evicted: int
    refused: int
    seconds: float
    first_failure: int | None  # the first prompt whose save failed
    outcomes: tuple[bool, ...]  # each prefetch's hit, in order: prefetch j reads what prompt j saved

    def hit_rate_from(self, prompt: int) -> float | None:
        """The share of hits among prefetches of prompts saved from ``prompt`` on."""
        tail = self.outcomes[prompt:]
        return sum(tail) / len(tail) if tail else None

    @property
    def hit_rate(self) -> float:
        return self.new_prefix_hits / self.prefetches if self.prefetches else 0.0


def _chain(keyer: BlockKeyer, tokens: list[int], d, identity: PublisherIdentity, nbytes: int) -> list[SaveBlock]:
    bs = d.block_size
    keys = keyer.keys(tokens)
    out = []
    for i, k in enumerate(keys):
        data = torch.full((nbytes,), k % 251, dtype=torch.uint8)
        out.append(SaveBlock(PayloadKey(d.descriptor_id, k, 0), data,
                             BlockIdentity(identity, tuple(tokens[i * bs:(i + 1) * bs]), bs,
                                           parent=keys[i - 1] if i else None), position=i))
    return out


def _readable(backend: RemoteBackend, chain: list[SaveBlock]) -> bool:
    out = torch.empty(chain[0].data.numel(), dtype=torch.uint8)
    for sb in chain:
        try:
            backend.read_verified(sb.key, out)
        except (DataPlaneError, KeyError):
            return False
    return True


def run_arm(arm: str, backend: RemoteBackend, *, prompts: int, hot_blocks: int, new_blocks: int, lag: int,
            layers: int, seed: int, half_life_s: float = 5.0) -> ArmResult:
    """One arm over ``prompts`` prompts (the same ones for a given ``seed``) against an emptied store."""
    backend.clear()
    d = known_model("meta-llama/Llama-3.1-8B", tenant_namespace=TENANT, num_layers=layers)
    nbytes = extent_bytes(d, 1)
    keyer = BlockKeyer(IdentityScope.of(d), d.block_size)
    identity = PublisherIdentity(tenant_namespace=TENANT, model=d.model, model_revision=d.model_revision,
                                 tokenizer_revision=d.tokenizer_revision, descriptor_id=d.descriptor_id,
                                 engine_family="bench")
    owner: RemoteTierOwner | None = None
    if arm.startswith("owner"):
        owner = build(Settings.from_env({"NEXUSKV_TIER_REUSE_HALF_LIFE": str(half_life_s)}), backend,
                      publish=lambda _b: None)
        owner.facts = TierFacts(OWNER, None)  # the decisions, not the bus: nothing is published
    bs = d.block_size
    gen = torch.Generator().manual_seed(seed)
    hot = torch.randint(1, 50_000, (hot_blocks * bs,), generator=gen).tolist()
    saved: list[list[SaveBlock]] = []
    blocks_saved = failed = prefetches = hits = hot_hits = 0
    first_failure: int | None = None
    outcomes: list[bool] = []  # per prefetch, in prompt order (prefetch j reads prompt j)
    t0 = time.perf_counter()
    for i in range(prompts):
        tail = torch.randint(1, 50_000, (new_blocks * bs,), generator=gen).tolist()
        chain = _chain(keyer, hot + tail, d, identity, nbytes)
        if owner is None:
            for sb in chain:
                data = sb.data.reshape(-1)
                try:
                    backend.put(PayloadHeader.for_data(sb.key, host_view(data)), data)
                    blocks_saved += 1
                except DataPlaneError:
                    failed += 1
                    first_failure = i if first_failure is None else first_failure
        else:
            save = save_and_offer(backend, chain, writer="bench-writer", tenant=TENANT, identity=identity,
                                  block_size=bs, offer_id=f"{arm}-{i}", now=time.time())
            blocks_saved += save.written
            failed += save.failed
            if save.failed and first_failure is None:
                first_failure = i
            for offer in save.offers:
                owner.handle_offer(offer)
            owner.keep_headroom()
            if i % 20 == 19:
                owner.sweep()
        saved.append(chain)
        if len(saved) > lag:  # another worker prefetches the prefix saved `lag` prompts ago
            target = saved[-(lag + 1)]
            cmd = None
            if owner is not None:
                now = time.time()
                cmd = TransferCommand(transfer_id=f"{arm}-t{i}", request_id=f"{arm}-r{i}",
                                      descriptor_id=d.descriptor_id, tenant_namespace=TENANT,
                                      keys=tuple(sb.key.key for sb in target),
                                      source=EntryLocation(worker=OWNER, tier=Tier.REMOTE),
                                      destination=EntryLocation(worker="bench-reader", tier=Tier.GPU),
                                      bytes=len(target) * nbytes, issued_at=now, deadline_at=now + 30)
                owner.transfer(cmd)
            prefetches += 1
            hit = _readable(backend, target)
            hits += hit
            outcomes.append(hit)
            hot_hits += _readable(backend, target[:hot_blocks])
            if owner is not None and cmd is not None:
                now = time.time()
                owner.result(TransferResult(transfer_id=cmd.transfer_id, request_id=cmd.request_id,
                                            status=TransferStatus.COMPLETED if hit else TransferStatus.NOT_FOUND,
                                            source=cmd.source, destination=cmd.destination, started_at=now,
                                            finished_at=now, error=None if hit else "a block was not there"))
        saved = saved[-(lag + 1):]
    seconds = time.perf_counter() - t0
    counters = owner.ledger.counters if owner is not None else {}
    return ArmResult(arm, prompts, blocks_saved, failed, prefetches, hits, hot_hits, counters.get("evicted", 0),
                     counters.get("refused", 0), round(seconds, 2), first_failure, tuple(outcomes))


def _after_fill(got: dict[str, ArmResult], arm: str) -> float | None:
    """``arm``'s hit rate over the prefetches of prompts saved once the unmanaged store first
    refused a save (the same prompts in every arm of a run)."""
    fill = got["unmanaged"].first_failure
    return None if fill is None else got[arm].hit_rate_from(fill)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--store-mib", type=int, default=32)
    ap.add_argument("--hot-blocks", type=int, default=4)
    ap.add_argument("--new-blocks", type=int, default=8)
    ap.add_argument("--lag", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--half-life", type=float, default=5.0,
                    help="the owner's reuse half-life (NEXUSKV_TIER_REUSE_HALF_LIFE), about the time within which "
                         "state is reused here; the owner-600s arm runs the default")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from tests.dataplane.remote_stores import Store

    work = Path(tempfile.mkdtemp(prefix="nexuskv-remote-owner-"))
    store = Store(work, args.store_mib << 20)
    backend = RemoteBackend(store.address, label=f"bench-{uuid.uuid4().hex[:4]}")
    load = []
    arms: list[dict[str, ArmResult]] = []
    try:
        for r in range(args.runs):
            order = ("unmanaged", "owner", "owner-600s") if r % 2 == 0 else ("owner-600s", "owner", "unmanaged")
            got = {}
            for arm in order:
                load.append(psutil.getloadavg()[0])
                got[arm] = run_arm(arm, backend, prompts=args.prompts, hot_blocks=args.hot_blocks,
                                   new_blocks=args.new_blocks, lag=args.lag, layers=args.layers, seed=r,
                                   half_life_s=600.0 if arm == "owner-600s" else args.half_life)
                a = got[arm]
                print(f"run {r} {arm:9s}: {a.blocks_saved} blocks saved, {a.failed_saves} failed, new-prefix hits "
                      f"{a.new_prefix_hits}/{a.prefetches} ({a.hit_rate:.2f}), hot {a.hot_hits}/{a.prefetches}, "
                      f"evicted {a.evicted}, refused {a.refused}, {a.seconds:.1f}s", flush=True)
            arms.append(got)
    finally:
        backend.close()
        store.proc.stop()
    command = (f"python -m benchmarks.remote_owner --runs {args.runs} --prompts {args.prompts} "
               f"--store-mib {args.store_mib} --half-life {args.half_life:g}")
    details = {"config": {k: v for k, v in vars(args).items() if k != "no_write"},
               "block_bytes": extent_bytes(known_model("meta-llama/Llama-3.1-8B", num_layers=args.layers), 1),
               "runs": [{k: {**{f: x for f, x in asdict(v).items() if f != "outcomes"}, "hit_rate": round(v.hit_rate, 4),
                             "hit_rate_after_fill": _after_fill(got, k)} for k, v in got.items()} for got in arms],
               "load_1min": {"median": statistics.median(load), "max": max(load)},
               "machine": f"{psutil.cpu_count()} cores, shared; load average during the arms in load_1min",
               "not_measured": "the bus between writer and owner (nexuskv.tier-offers on Kafka): the owner is called "
                               "in process; housekeeping runs after every prompt, the service runs it every second"}
    details["after_fill_median"] = {k: statistics.median(x for x in (_after_fill(g, k) for g in arms) if x is not None)
                                    if any(_after_fill(g, k) is not None for g in arms) else None
                                    for k in arms[0]}
    ratio_hits = [Run(g["owner"].hit_rate, g["unmanaged"].hit_rate) for g in arms]
    ratio_failed = [Run(g["owner"].failed_saves, g["unmanaged"].failed_saves) for g in arms]
    hits_med = statistics.median(r.value for r in ratio_hits)
    base_med = statistics.median(r.baseline for r in ratio_hits)
    for got in arms:
        print("after the store filled: " + ", ".join(f"{k} {_after_fill(got, k)}" for k in got))
    print(f"new-prefix hit rate: owner {hits_med:.2f} vs unmanaged {base_med:.2f}; failed saves: owner "
          f"{statistics.median(r.value for r in ratio_failed):.0f} vs unmanaged "
          f"{statistics.median(r.baseline for r in ratio_failed):.0f}")
    if not args.no_write:
        write_result("remote_owner_hits", "share of new-prefix prefetches served from the remote tier", "fraction",
                     ratio_hits, "unmanaged remote tier (no owner: puts fail once full)", command, details)
        write_result("remote_owner_failed_saves", "remote-tier block saves that failed", "blocks", ratio_failed,
                     "unmanaged remote tier (no owner: puts fail once full)", command, details)
    return 0


if __name__ == "__main__":
    sys.exit(main())
