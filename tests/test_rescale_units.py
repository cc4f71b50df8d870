"""The pure parts of a live rescale: the target assignment and its steps, the senders of an
exchange at join, drain and retire markers, channels joining the aligners, and the readers of
a source task that was handed splits."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.alignment import BarrierAligner, TriggerSnapshot
from abs.connectors.sources import END, GeneratorSource
from abs.dataflow import KEY_BY, REBALANCE
from abs.errors import AlignmentError, ReconfigurationError
from abs.keygroups import key_groups
from abs.reconfig import Assignment
from abs.reconfig.aligner import StepAligner
from abs.reconfig.plan import DRAIN, JOIN, RETIRE, plan_rescale, rescale_target, spread_splits
from abs.runtime.channels import EOS, Barrier, InputGate, StepMarker, decode, encode
from abs.runtime.messages import ChannelAdded
from abs.runtime.plan import OutputPlan
from abs.runtime.split_readers import SourceReaders
from abs.runtime.task import ExchangeWriter


# ----------------------------------------------------------------------------- plans
@st.composite
def assignments(draw):
    M = draw(st.integers(1, 64))
    P = draw(st.integers(1, min(M, 8)))
    owners = tuple(draw(st.lists(st.integers(0, P - 1), min_size=M, max_size=M)))
    return Assignment(owners, P)


@settings(max_examples=300, deadline=None)
@given(current=assignments(), data=st.data())
def test_a_rescale_target_evens_the_shares_out_with_the_fewest_moves(current, data):
    M, P = current.max_parallelism, current.workers
    workers = data.draw(st.integers(1, M))
    target = rescale_target(current, workers)
    counts = [len(target.key_groups_of(w)) for w in range(workers)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == M
    assert all(0 <= w < workers for w in target.owners)
    # fewest moves: every key group a worker keeps up to its share stays where it is
    share = {w: c for w, c in enumerate(counts)}
    must_move = sum(max(0, len(current.key_groups_of(w)) - share.get(w, 0)) for w in range(P))
    moved = sum(a != b for a, b in zip(current.owners, target.owners))
    assert moved == must_move


@settings(max_examples=200, deadline=None)
@given(current=assignments(), data=st.data())
def test_rescale_steps_join_first_and_drain_then_retire_last(current, data):
    M, P = current.max_parallelism, current.workers
    workers = data.draw(st.integers(1, M).filter(lambda n: n != P))
    strategy = data.draw(st.sampled_from(["all_at_once", "batched", "fluid"]))
    batch = 2 if strategy == "batched" else None
    target, steps = plan_rescale(current, workers, strategy, batch)
    state = current.widened(max(P, workers))
    for step in steps:
        state = state.applied(step.moves)
    assert state.owners == target.owners
    if workers > P:
        assert steps[0].phase == JOIN and steps[0].workers == workers
        assert all(s.phase == "" for s in steps[1:])
        # nothing moves to a worker that has not joined: the join step comes first
    else:
        assert [s.phase for s in steps[-2:]] == [DRAIN, RETIRE] and not steps[-1].moves and not steps[-2].moves
        assert all(s.workers == workers for s in steps[-2:])
        assert all(mv.target < workers for s in steps for mv in s.moves)  # nothing moves to a leaving worker
        assert all(owner < workers for owner in state.owners)  # the leaving workers own nothing at the drain


@settings(max_examples=300, deadline=None)
@given(owners=st.dictionaries(st.text("0123456789abc", min_size=1, max_size=3), st.integers(0, 5), max_size=20),
       workers=st.integers(1, 6))
def test_splits_even_out_over_the_workers_with_the_fewest_moves(owners, workers):
    moves = spread_splits(owners, workers)
    after = dict(owners)
    for a, b, splits in moves:
        assert a != b and b < workers and splits
        for s in splits:
            assert after[s] == a
            after[s] = b
    counts = [sum(1 for w in after.values() if w == k) for k in range(workers)]
    assert all(w < workers for w in after.values()) and max(counts) - min(counts) <= 1
    n = len(owners)
    share = [n // workers + (1 if w < n % workers else 0) for w in range(workers)]
    # fewest moves: a worker keeps its own splits up to its share, a leaving one none
    must = sum(max(0, sum(1 for w in owners.values() if w == k) - (share[k] if k < workers else 0))
               for k in set(owners.values()))
    assert sum(len(s) for _a, _b, s in moves) == must


def test_rescale_requests_are_checked():
    current = Assignment.initial(8, 2)
    for workers, match in [(0, r"\[1, 8\]"), (9, "max_parallelism=8"), (2, "already")]:
        with pytest.raises(ReconfigurationError, match=match):
            plan_rescale(current, workers)
    with pytest.raises(ReconfigurationError, match="strategy"):
        plan_rescale(current, 3, "sideways")


# ----------------------------------------------------------------------------- the senders of an exchange
class _Recorder:
    def __init__(self, log, name):
        self.log, self.name, self.closed = log, name, False

    def send(self, item):
        assert not self.closed, f"{self.name}: sent after close"
        self.log.append((self.name, item))

    def close(self):
        self.closed = True


def _items(log, name):
    return [item for n, item in log if n == name]


def _rows(items):
    return [k for it in items if isinstance(it, pa.RecordBatch) for k in it.column("key").to_pylist()]


def test_a_join_marker_is_the_first_element_on_every_new_channel():
    M = 12
    log: list = []
    out = OutputPlan(0, 1, 1, 0, KEY_BY, "key")
    joining = [_Recorder(log, 2)]
    w = ExchangeWriter(out, [_Recorder(log, 0), _Recorder(log, 1)], np.array([kg * 2 // M for kg in range(M)]), M,
                       "count", joining)
    keys = list(range(300))
    kgs = key_groups(np.array(keys), M)
    w(pa.record_batch({"key": pa.array(keys)}))
    gained = [kg for kg in range(M) if kg % 3 == 0]
    w.switch(StepMarker(4, tuple((kg, 2) for kg in gained), 0, 3, JOIN))
    w(pa.record_batch({"key": pa.array(keys)}))
    new = _items(log, 2)
    assert isinstance(new[0], StepMarker) and new[0].step == 4  # first element: the join marker
    assert sorted(_rows(new)) == sorted(k for k, g in zip(keys, kgs) if g in gained)
    for old in (0, 1):
        items = _items(log, old)
        at = next(i for i, it in enumerate(items) if isinstance(it, StepMarker))
        assert not {k for k, g in zip(keys, kgs) if g in gained} & set(_rows(items[at + 1:]))
    assert joining == [] and len(w.senders) == 3


def test_drain_stops_records_to_leaving_workers_and_retire_ends_their_channels():
    log: list = []
    out = OutputPlan(0, 1, 1, 0, REBALANCE, None)
    w = ExchangeWriter(out, [_Recorder(log, n) for n in range(3)], np.zeros(4, dtype=np.int64), 4, "next")
    batch = pa.record_batch({"key": pa.array([1, 2])})
    for _ in range(6):
        w(batch)
    w.switch(StepMarker(7, (), 0, 2, DRAIN))
    for _ in range(6):
        w(batch)
    w.send_all(Barrier(3))  # barriers still reach the leaving worker until it retires
    w.switch(StepMarker(8, (), 0, 2, RETIRE))
    for _ in range(4):
        w(batch)
    leaving = _items(log, 2)
    drain_at = next(i for i, it in enumerate(leaving) if isinstance(it, StepMarker))
    assert not any(isinstance(it, pa.RecordBatch) for it in leaving[drain_at:])
    assert leaving[drain_at + 1:] == [Barrier(3), StepMarker(8, (), 0, 2, RETIRE), EOS]
    assert log[-1][0] != 2 and len(w.senders) == 2
    assert [len(_rows(_items(log, n))) for n in (0, 1)] == [2 * 2 + 2 * 3 + 2 * 2] * 2  # 2 rows a batch


def test_a_step_marker_with_a_phase_survives_the_wire():
    marker = StepMarker(9, ((3, 2), (4, 0)), 5, 3, RETIRE)
    assert decode(bytes(encode(marker))) == marker


# ----------------------------------------------------------------------------- aligners
def test_a_joined_channel_counts_from_the_next_checkpoint_only():
    a = BarrierAligner(2)
    assert a.on_barrier(0, 5) == ()
    with pytest.raises(AlignmentError, match="cannot join now"):
        a.add_channel(2)  # never while a checkpoint aligns
    assert a.on_barrier(1, 5) == (TriggerSnapshot(5),)
    a.add_channel(2)
    assert a.on_barrier(0, 6) == () and a.on_barrier(1, 6) == ()
    assert a.on_barrier(2, 6) == (TriggerSnapshot(6),)  # the new channel is waited for


def test_a_channel_joining_while_a_step_aligns_waits_for_that_step():
    s = StepAligner(2)
    assert not s.on_marker(0, 3)
    s.add_channel(2)  # joined while step 3 aligns: it never delivers step 3
    assert 2 in s.blocked  # and nothing is read from it before step 3 is aligned
    assert s.on_marker(1, 3)
    assert not s.on_marker(0, 4) and not s.on_marker(1, 4)
    assert s.on_marker(2, 4)  # from the next step on it counts


def test_a_gate_announces_a_new_channel_before_its_first_element():
    gate = InputGate(1)
    ch = gate.add_channel(ChannelAdded)
    gate.put(ch, "first")
    assert gate.take(frozenset(), 0.1) == (-1, ChannelAdded(1))
    assert gate.take(frozenset(), 0.1) == (1, "first")


# ----------------------------------------------------------------------------- readers of handed-over splits
def test_a_source_task_reads_its_own_and_the_handed_over_splits_to_their_end():
    source = GeneratorSource(400, num_keys=7, num_splits=4, batch_size=25)
    splits = sorted(source.splits())
    mine = SourceReaders(source.create_reader({s: source.initial_offset(s) for s in splits[:2]}, 0, 2))
    theirs = source.create_reader({s: source.initial_offset(s) for s in splits[2:]}, 1, 2)
    rows = []
    for _ in range(3):
        rows += theirs.poll().column("key").to_pylist()
    handed = SourceReaders(theirs).release()  # the leaving task's offsets at the drain
    assert set(handed) == set(splits[2:])
    mine.add(source.create_reader(handed, 0, 2))
    while (batch := mine.poll()) is not END:
        if batch is not None:
            rows += batch.column("key").to_pylist()
    assert len(rows) == 400
    assert set(mine.offsets()) == set(splits)
