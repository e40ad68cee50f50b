"""The replay's request stream: whole conversations, deterministic tokens, shared prefixes kept."""

from __future__ import annotations

from streams.app.replay.workload import WorkloadShape, build_workload
from streams.app.traces import TraceRequest, load_trace

from benchmarks.trace_events import CONVERSATION_SLICE


def test_default_takes_whole_conversations_from_the_whole_trace_up_to_the_cap():
    trace = load_trace(CONVERSATION_SLICE)
    w = build_workload(trace, WorkloadShape(max_requests=40, warmup=10))
    assert 0 < len(w.requests) <= 40 and w.skipped == len(trace) - len(w.requests)
    turns: dict[int, int] = {}
    for r in w.requests:
        turns[r.conversation] = turns.get(r.conversation, 0) + 1
    assert all(n >= 2 for n in turns.values())  # only conversations with follow-ups, every turn of each
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert [r.warmup for r in w.requests] == [i < 10 for i in range(len(w.requests))]
    assert len(w.measured) == len(w.requests) - 10 and "skipped" in w.describe()


def test_equal_hash_ids_give_equal_token_prefixes_and_the_caps_hold():
    a = TraceRequest(0, 2048, 10, (0, 1, 2, 3))
    b = TraceRequest(1000, 4096, 10, (0, 1, 2, 3, 4, 5, 6, 7))
    shape = WorkloadShape(hash_block_tokens=32, max_prompt_tokens=200, follow_ups=False, max_gap_s=0.5, warmup=0,
                          time_scale=10)
    w = build_workload([a, b], shape)
    ra, rb = w.requests
    assert ra.tokens == rb.tokens[: len(ra.tokens)] and len(ra.tokens) == 128 and len(rb.tokens) == 200
    assert min(rb.tokens) >= 4 and max(rb.tokens) < shape.vocab  # the models' special ids are never sent
    assert rb.arrival_s == 0.1  # 1 s of trace time / time scale 10, under the gap cap
    assert build_workload([a, b], shape).requests == w.requests  # deterministic


def test_conversations_take_every_turn_of_the_first_n_in_time_order():
    trace = load_trace(CONVERSATION_SLICE)
    w = build_workload(trace, WorkloadShape(max_requests=1000, conversations=8))
    keys = {r.conversation for r in w.requests}
    assert len(keys) == 8
    assert [r.arrival_s for r in w.requests] == sorted(r.arrival_s for r in w.requests)
    assert all(sum(1 for r in w.requests if r.conversation == k) >= 2 for k in keys)
    turns = {k: sum(1 for t in trace if len(t.hash_ids) > 1 and t.hash_ids[1] == k) for k in keys}
    assert len(w.requests) == sum(turns.values())  # every turn of each
    first = build_workload(trace, WorkloadShape(max_requests=5, follow_ups=False))
    assert [r.seq for r in first.requests] == [0, 1, 2, 3, 4] and first.skipped == len(trace) - 5


def test_skewed_shape_puts_a_few_hot_conversations_behind_one_prefix_then_bursts_their_turns():
    trace = load_trace(CONVERSATION_SLICE)
    shape = WorkloadShape(max_requests=100, warmup=5, hot=4, shared_prefix_blocks=8, opener_gap_s=2.0,
                          burst_gap_s=0.1)
    w = build_workload(trace, shape)
    warm, measured = w.requests[:5], w.measured
    assert all(r.warmup for r in warm) and not any(r.warmup for r in measured) and shape.name == "skewed"
    hot = {r.conversation for r in measured}
    assert len(hot) == 4 and not hot & {r.conversation for r in warm}  # the warm-up is none of the hot ones
    prefix = measured[0].tokens[: 8 * 32]
    assert all(r.tokens[: 8 * 32] == prefix for r in measured)  # one shared prefix in front of every hot turn
    assert not any(r.tokens[: 8 * 32] == prefix for r in warm)
    openers, burst = measured[:4], measured[4:]
    assert [r.arrival_s for r in openers] == [0.0, 2.0, 4.0, 6.0]  # one conversation's opener at a time
    assert len({r.conversation for r in openers}) == 4
    gaps = {round(b.arrival_s - a.arrival_s, 6) for a, b in zip(burst, burst[1:])}
    assert burst and burst[0].arrival_s == 8.0 and gaps == {0.1}
    # A later turn extends its conversation's earlier one: its history is a reusable prefix.
    first = {r.conversation: r for r in openers}
    assert all(r.tokens[: len(first[r.conversation].tokens) - 32] == first[r.conversation].tokens[:-32]
               for r in burst if len(first[r.conversation].tokens) > 32)
    assert build_workload(trace, shape).requests == w.requests  # deterministic
