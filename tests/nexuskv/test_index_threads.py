"""Lookups from other threads while one thread writes: every answer is a state the index went
through, and nothing raises.

The writer publishes how many of its steps are done (``done``, set after each step); a reader
reads it before (``p0``) and after (``p1``) a lookup, so the lookup saw a state between the end
of step ``p0`` and the end of step ``p1 + 1`` (one may be under way). Its answer must be the
expected answer of one of those states.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from nexuskv._native import Core
from nexuskv.contracts.kv_events import AllCleared, BlockRemoved, BlockStored, PublisherIdentity
from nexuskv.index import GlobalIndex, KeyedBlocks

from tests.factories import publisher_identity, scope

READERS = 3


@pytest.fixture(autouse=True)
def _switch_often():
    """Threads switch every few bytecodes instead of every 5 ms, so that races show."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class Writer:
    """Runs ``steps`` (callables) in order in its own thread, counting those done."""

    def __init__(self, steps) -> None:
        self.steps = steps
        self.done = 0
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            for step in self.steps:
                step()
                self.done += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.finished.set()


def run_readers(writer: Writer, look, expected: list, readers: int = READERS, valid=None) -> list[int]:
    """Start the writer and ``readers`` threads calling ``look()`` until it is done; each answer
    must be ``expected[s]`` for a state ``s`` the lookup may have seen (or satisfy
    ``valid(answer, allowed)``). Returns the lookups per reader."""
    valid = valid or (lambda got, allowed: got in allowed)
    violations: list[str] = []
    errors: list[BaseException] = []
    counts = [0] * readers
    start = threading.Barrier(readers + 1)

    def read(r: int) -> None:
        try:
            start.wait()
            while True:
                last = writer.finished.is_set()
                p0 = writer.done
                got = look()
                p1 = writer.done
                counts[r] += 1
                allowed = expected[p0:min(p1 + 2, len(expected))]
                if not valid(got, allowed):
                    violations.append(f"steps {p0}..{p1}: {got!r} not among {allowed!r}")
                if last or violations:
                    return
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(readers)]
    for t in threads:
        t.start()
    w = threading.Thread(target=lambda: (start.wait(), writer.run()))
    w.start()
    w.join(timeout=300)
    for t in threads:
        t.join(timeout=300)
    assert not w.is_alive() and not any(t.is_alive() for t in threads), "a thread hung"
    assert writer.error is None, writer.error
    assert not errors, errors
    assert not violations, violations[:5]
    return counts


# -- the native core -------------------------------------------------------------------------------


def test_native_lookups_in_threads_see_a_prefix_of_a_chain_being_stored_and_removed():
    core = Core(os.urandom(32))
    pub = core.add_publisher()
    loc = core.add_location(pub)
    sid, _serial = core.add_scope(b"s" * 16)
    n = 600
    keys = os.urandom(16 * n)
    steps, expected = [], [[]]
    for i in range(n):  # one block at a time, in chain order
        steps.append(lambda i=i: core.store(pub, loc, sid, keys[16 * i:16 * i + 16], [i]))
        expected.append([(loc, i + 1, ())])
    for i in reversed(range(n)):  # then from the tail back
        steps.append(lambda i=i: core.remove(pub, loc, [i]))
        expected.append([(loc, i, ())] if i else [])
    counts = run_readers(Writer(steps), lambda: core.lookup(sid, keys), expected)
    assert min(counts) >= 1
    assert core.blocks == 0 and core.memberships == 0


def test_native_writes_from_two_threads_are_serialised():
    core = Core(os.urandom(32))
    pubs = [core.add_publisher() for _ in range(2)]
    locs = [core.add_location(p) for p in pubs]
    sid, _serial = core.add_scope(b"t" * 16)
    keys = [os.urandom(16 * 20_000) for _ in pubs]

    def write(k: int) -> None:
        for s in range(0, 20_000, 500):  # grows the table several times, from both threads
            core.store(pubs[k], locs[k], sid, keys[k][16 * s:16 * (s + 500)], list(range(s, s + 500)))

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert core.blocks == 40_000 and core.memberships == 40_000
    for k in range(2):
        assert core.lookup(sid, keys[k]) == [(locs[k], 20_000, ())]


# -- GlobalIndex -----------------------------------------------------------------------------------

IDENT = publisher_identity()
SCOPE = scope(tenant=IDENT.tenant_namespace)


def _keyed(keys: bytes, hashes: list[int], **kw) -> KeyedBlocks:
    return KeyedBlocks(engine_hashes=hashes, keys=keys, **kw)


def test_lookups_in_threads_see_states_the_index_went_through_across_gaps_and_resyncs():
    """Chain A stored block by block (certain), a sequence gap (A uncertain), a full clear (a
    resync: nothing, certain), chain B stored after A's place and removed from its tail; three
    rounds. A lookup of A + B may never report A as certain once the gap is behind it. Reporting
    a state's facts as uncertain when they were certain is allowed (an uncertain match is a miss)."""
    index = GlobalIndex(secret=b"threads")
    na, nb = 40, 30
    keys_a, keys_b = os.urandom(16 * na), os.urandom(16 * nb)
    query = keys_a + keys_b
    pub = "w1/gpu0"
    seq = 0
    steps: list = []
    expected: list = [None]

    def batch(events, *, skip: int = 0):
        nonlocal seq
        seq += skip
        s = seq
        seq += 1
        return lambda: index.apply_events(pub, 1, s, IDENT, events)

    for r in range(3):
        for i in range(na):
            steps.append(batch((_keyed(keys_a[16 * i:16 * i + 16], [1000 * r + i]),)))
            expected.append((i + 1, (), True))
        steps.append(batch((), skip=1))  # a gap: A's facts stay, uncertain
        expected.append((na, (), False))
        steps.append(batch((AllCleared(),)))  # the resync
        expected.append(None)
        for j in range(nb):
            steps.append(batch((_keyed(keys_b[16 * j:16 * j + 16], [10_000 + 1000 * r + j]),)))
            expected.append((0, ((na, na + j + 1),), True))
        for j in reversed(range(nb)):
            steps.append(batch((BlockRemoved(engine_hashes=(10_000 + 1000 * r + j,)),)))
            expected.append((0, ((na, na + j),), True) if j else None)

    def look():
        got = index.lookup(SCOPE, query)
        assert got.num_blocks == na + nb
        if not got.matches:
            return None
        (m,) = got.matches
        assert (m.publisher, m.location.worker) == (pub, pub)
        return (m.prefix_blocks, tuple((e.start, e.end) for e in m.extents), m.certain)

    def valid(got, allowed) -> bool:
        return got in allowed or (got is not None and not got[2] and any(
            a is not None and a[:2] == got[:2] for a in allowed))

    run_readers(Writer(steps), look, expected, valid=valid)
    assert index.stats().resyncs == 3


def test_a_scope_freed_and_reused_by_another_tenant_never_answers_for_the_first():
    """Tenant x's publisher stores keys K and removes them (its scope is freed); tenant y's
    publisher then stores the same K (its scope takes the freed id) and removes them; over and
    over. A lookup of K in x's scope sees x's facts or nothing, never y's."""
    index = GlobalIndex(secret=b"threads")
    n = 16
    keys = os.urandom(16 * n)
    x, y = scope(tenant="tenant-x"), scope(tenant="tenant-y")
    ident = {t: PublisherIdentity(tenant_namespace=t, model=IDENT.model, model_revision=IDENT.model_revision,
                                  tokenizer_revision=IDENT.tokenizer_revision, descriptor_id=IDENT.descriptor_id)
             for t in ("tenant-x", "tenant-y")}
    seq = {"x/gpu0": 0, "y/gpu0": 0}
    steps, expected_x = [], [None]

    def apply(pub: str, tenant: str, events):
        s = seq[pub]
        seq[pub] += 1
        return lambda: index.apply_events(pub, 1, s, ident[tenant], events)

    hashes = list(range(1, n + 1))
    for _ in range(150):
        steps.append(apply("x/gpu0", "tenant-x", (_keyed(keys, hashes),)))
        expected_x.append(("x/gpu0", n))
        steps.append(apply("x/gpu0", "tenant-x", (BlockRemoved(engine_hashes=tuple(hashes)),)))
        expected_x.append(None)
        steps.append(apply("y/gpu0", "tenant-y", (_keyed(keys, hashes),)))
        expected_x.append(None)
        steps.append(apply("y/gpu0", "tenant-y", (BlockRemoved(engine_hashes=tuple(hashes)),)))
        expected_x.append(None)

    def look_x():
        got = index.lookup(x, keys)
        if not got.matches:
            return None
        (m,) = got.matches
        return (m.publisher, m.prefix_blocks)

    run_readers(Writer(steps), look_x, expected_x)
    assert index.lookup(y, keys).matches == () and index.stats().scopes == 0


def test_token_lookups_and_inspection_in_threads_while_token_events_apply():
    index = GlobalIndex(secret=b"threads")
    bs, n = 4, 120
    tokens = list(range(7, 7 + bs * n))
    pub = "w2/gpu0"
    steps, expected = [], [0]
    for i in range(n):
        event = BlockStored(engine_hashes=(i,), parent=i - 1 if i else None,
                            token_ids=tuple(tokens[i * bs:(i + 1) * bs]), block_size=bs)
        steps.append(lambda i=i, event=event: index.apply_events(pub, 1, i, IDENT, (event,)))
        expected.append(i + 1)

    def look():
        got = index.lookup_tokens(SCOPE, tokens, bs)
        status = index.publisher_status(pub)
        stats = index.stats()
        assert status is None or status.certain
        assert stats.blocks <= n and stats.uncertain_publishers == 0
        assert index.publishers() in ((), (pub,))
        return got.matches[0].prefix_blocks if got.matches else 0

    run_readers(Writer(steps), look, expected)
    assert index.memberships == n


@pytest.mark.parametrize("worker_first", [False, True])
def test_a_publisher_moved_to_its_worker_is_answered_under_the_new_name(worker_first):
    """A cached match names its location's worker; when the publisher's identity says whose
    worker it is, the next lookup names that worker (the cache is replaced)."""
    index = GlobalIndex(secret=b"threads")
    keys = os.urandom(16 * 4)
    index.apply_events("w3/gpu0", 1, 0, IDENT, (_keyed(keys, [1, 2, 3, 4]),))
    before = index.lookup(SCOPE, keys).matches[0]
    assert before.location.worker == "w3/gpu0"
    moved = IDENT.model_copy(update={"worker": "w3"})
    index.apply_events("w3/gpu0", 1, 1, moved, () if worker_first else (_keyed(keys, [1, 2, 3, 4]),))
    after = index.lookup(SCOPE, keys).matches[0]
    assert (after.location.worker, after.publisher, after.prefix_blocks) == ("w3", "w3/gpu0", 4)


# -- the interleavings above, made to happen: a write between a lookup's steps ---------------------


class _Between:
    """The index's core, with ``hook`` run once inside the next lookup: ``before`` the core
    answers (after the index read the scope's id), or after it (before the index reads the
    publishers' certainty)."""

    def __init__(self, core, hook, *, before: bool) -> None:
        self._core, self._hook, self._before = core, hook, before

    def __getattr__(self, name):
        return getattr(self._core, name)

    def lookup(self, *args):
        hook, self._hook = self._hook, None
        if hook and self._before:
            hook()
        got = self._core.lookup(*args)
        if hook and not self._before:
            hook()
        return got


def test_a_resync_between_the_core_answer_and_the_certainty_read_is_not_reported_certain():
    index = GlobalIndex(secret=b"threads")
    keys = os.urandom(16 * 8)
    index.apply_events("w4/gpu0", 1, 0, IDENT, (_keyed(keys, list(range(8))),))
    index.apply_events("w4/gpu0", 1, 2, IDENT, ())  # a gap: the facts stay, uncertain
    (m,) = index.lookup(SCOPE, keys).matches
    assert (m.prefix_blocks, m.certain) == (8, False)
    core = index._core
    index._core = _Between(core, lambda: index.apply_events("w4/gpu0", 1, 3, IDENT, (AllCleared(),)), before=False)
    got = index.lookup(SCOPE, keys)  # the core saw the old facts; the publisher is certain when they are read
    index._core = core
    assert got.matches == (), "facts from before the resync, reported as they are now: none"
    assert index.publisher_status("w4/gpu0").certain


def test_a_scope_freed_and_reused_between_the_id_read_and_the_core_answer_answers_nothing():
    index = GlobalIndex(secret=b"threads")
    keys = os.urandom(16 * 4)
    x, ident_y = scope(tenant="tenant-x"), IDENT.model_copy(update={"tenant_namespace": "tenant-y"})
    ident_x = IDENT.model_copy(update={"tenant_namespace": "tenant-x"})
    index.apply_events("x/gpu0", 1, 0, ident_x, (_keyed(keys, [1, 2, 3, 4]),))

    def free_and_reuse() -> None:
        index.apply_events("x/gpu0", 1, 1, ident_x, (BlockRemoved(engine_hashes=(1, 2, 3, 4)),))
        index.apply_events("y/gpu0", 1, 0, ident_y, (_keyed(keys, [1, 2, 3, 4]),))

    sid_x = index._scope_ids[x][0]
    core = index._core
    index._core = _Between(core, free_and_reuse, before=True)
    got = index.lookup(x, keys)
    index._core = core
    assert index._scope_ids[scope(tenant="tenant-y")][0] == sid_x, "the premise: y took x's freed id"
    assert got.matches == (), "tenant y's blocks under tenant x's old scope id"
    assert index.lookup(scope(tenant="tenant-y"), keys).matches[0].publisher == "y/gpu0"
    assert index.stats().scopes == 1
