"""Barrier alignment: table tests of every transition, and a simulation of FIFO channels
carrying epoch-tagged records checking that each snapshot holds exactly the records sent
before its barrier."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.alignment import AbortCheckpoint, BarrierAligner, EndOfInput, TriggerSnapshot
from abs.errors import AlignmentError, ConfigError


def aborted(n, contains=""):
    """Matcher helper: an AbortCheckpoint for n whose reason contains ``contains``."""
    return ("abort", n, contains)


def check(actions, *expected):
    assert len(actions) == len(expected), actions
    for got, want in zip(actions, expected):
        if isinstance(want, tuple):
            assert isinstance(got, AbortCheckpoint) and got.checkpoint_id == want[1], got
            assert want[2] in got.reason, got.reason
        else:
            assert got == want


# ----------------------------------------------------------------------------- table tests


def test_initial_state():
    a = BarrierAligner(3)
    assert a.blocked == frozenset() and a.live == {0, 1, 2} and a.aligning is None
    assert not a.finished and a.num_channels == 3
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="at least one input channel"):
            BarrierAligner(bad)


def test_single_channel_triggers_at_once():
    a = BarrierAligner(1)
    check(a.on_barrier(0, 1), TriggerSnapshot(1))
    assert a.blocked == frozenset() and a.aligning is None
    check(a.on_barrier(0, 2), TriggerSnapshot(2))


def test_alignment_blocks_each_channel_until_all_delivered_then_unblocks_in_the_same_step():
    a = BarrierAligner(3)
    check(a.on_barrier(0, 5))
    assert a.aligning == 5 and a.blocked == {0}
    check(a.on_barrier(2, 5))
    assert a.blocked == {0, 2}
    check(a.on_barrier(1, 5), TriggerSnapshot(5))
    assert a.aligning is None and a.blocked == frozenset()


def test_unblocked_channels_keep_flowing_while_one_is_blocked():
    a = BarrierAligner(2)
    a.on_barrier(0, 1)
    # the runtime may consume records of channel 1 as long as it likes: no event needed,
    # and channel 1 is not blocked
    assert 1 not in a.blocked and 0 in a.blocked


def test_newer_barrier_aborts_and_starts_aligning_the_newer_one():
    a = BarrierAligner(3)
    a.on_barrier(0, 1)
    check(a.on_barrier(1, 2), aborted(1, "newer barrier 2 on channel 1"))
    assert a.aligning == 2 and a.blocked == {1}
    check(a.on_barrier(2, 1))  # late barrier of the aborted checkpoint: ignored, not blocked
    assert a.blocked == {1}
    check(a.on_barrier(0, 2))
    check(a.on_barrier(2, 2), TriggerSnapshot(2))


def test_newer_barrier_on_the_last_live_channel_can_trigger_at_once():
    a = BarrierAligner(2)
    a.on_end_of_stream(1)
    check(a.on_barrier(0, 1), TriggerSnapshot(1))
    a = BarrierAligner(1)
    check(a.on_barrier(0, 3), TriggerSnapshot(3))
    check(a.on_barrier(0, 2))  # older than the last triggered: ignored


def test_barriers_for_closed_ids_are_ignored_and_never_block():
    a = BarrierAligner(2)
    a.on_barrier(0, 3)
    a.on_barrier(1, 3)  # triggered 3
    for cid in (1, 2, 3):
        check(a.on_barrier(0, cid))
        check(a.on_cancel(1, cid))
    assert a.blocked == frozenset() and a.aligning is None


def test_cancel_while_aligning_the_same_id_aborts_and_unblocks():
    a = BarrierAligner(3)
    a.on_barrier(0, 4)
    a.on_barrier(1, 4)
    check(a.on_cancel(2, 4), aborted(4, "cancel marker on channel 2"))
    assert a.blocked == frozenset() and a.aligning is None
    check(a.on_barrier(2, 4))  # late: ignored
    assert a.blocked == frozenset()


def test_cancel_while_idle_aborts_once():
    a = BarrierAligner(3)
    check(a.on_cancel(0, 2), aborted(2, "cancel marker on channel 0"))
    check(a.on_cancel(1, 2))
    check(a.on_barrier(2, 2))
    assert a.blocked == frozenset()
    check(a.on_barrier(2, 3))
    assert a.aligning == 3


def test_cancel_for_a_newer_id_aborts_the_current_one_and_the_newer_one():
    a = BarrierAligner(2)
    a.on_barrier(0, 1)
    check(a.on_cancel(1, 2), aborted(1, "cancel marker for newer checkpoint 2"), aborted(2, "cancel"))
    assert a.blocked == frozenset() and a.aligning is None
    check(a.on_barrier(0, 2))
    check(a.on_barrier(1, 1))
    check(a.on_cancel(0, 1))


def test_older_cancel_or_barrier_while_aligning_is_ignored():
    a = BarrierAligner(3)
    a.on_barrier(0, 5)
    check(a.on_cancel(1, 4))
    check(a.on_barrier(1, 3))
    assert a.aligning == 5 and a.blocked == {0}


def test_coordinator_abort_of_the_aligned_checkpoint():
    a = BarrierAligner(2)
    a.on_barrier(0, 1)
    check(a.abort(1, "timeout"), aborted(1, "timeout"))
    assert a.blocked == frozenset() and a.aligning is None
    check(a.abort(1))
    check(a.on_barrier(1, 1))
    assert a.blocked == frozenset()


def test_coordinator_abort_of_another_checkpoint_keeps_the_current_alignment():
    a = BarrierAligner(2)
    a.on_barrier(0, 1)
    check(a.abort(3), aborted(3, "coordinator"))
    check(a.abort(3))
    assert a.aligning == 1 and a.blocked == {0}
    check(a.abort(0))  # older than the current one: already closed
    check(a.on_barrier(1, 1), TriggerSnapshot(1))
    check(a.on_barrier(0, 3))  # aborted ahead: ignored, not blocked
    check(a.on_cancel(1, 3))
    assert a.blocked == frozenset()
    check(a.on_barrier(0, 2))
    check(a.on_barrier(1, 2), TriggerSnapshot(2))


def test_barrier_of_an_aborted_newer_id_still_aborts_the_current_one():
    # the channel went past barrier 1 without delivering it: 1 can never align here
    a = BarrierAligner(2)
    a.on_barrier(0, 1)
    a.abort(2)
    check(a.on_barrier(1, 2), aborted(1, "newer barrier 2"))
    assert a.aligning is None and a.blocked == frozenset()


def test_coordinator_abort_while_idle_is_remembered():
    a = BarrierAligner(2)
    check(a.abort(7, "declined elsewhere"), aborted(7, "declined elsewhere"))
    check(a.on_barrier(0, 7))
    assert a.blocked == frozenset()
    check(a.on_barrier(0, 8))
    assert a.aligning == 8


def test_end_of_stream_counts_as_aligned_and_can_complete_an_alignment():
    a = BarrierAligner(3)
    a.on_barrier(0, 1)
    a.on_barrier(1, 1)
    check(a.on_end_of_stream(2), TriggerSnapshot(1))
    assert a.live == {0, 1} and a.blocked == frozenset()
    check(a.on_barrier(0, 2))
    check(a.on_barrier(1, 2), TriggerSnapshot(2))  # channel 2 ended: aligned for 2 as well
    check(a.on_end_of_stream(0))
    check(a.on_end_of_stream(1), EndOfInput())
    assert a.finished and a.live == frozenset()
    check(a.abort(9))  # after the end: nothing to do


def test_end_of_stream_while_idle_and_all_ended():
    a = BarrierAligner(2)
    check(a.on_end_of_stream(1))
    check(a.on_end_of_stream(0), EndOfInput())
    assert a.finished


@pytest.mark.parametrize(
    "prepare,event,match",
    [
        (lambda a: a.on_barrier(0, 1), lambda a: a.on_barrier(0, 1), "blocked for checkpoint 1"),
        (lambda a: a.on_barrier(0, 1), lambda a: a.on_cancel(0, 1), "blocked"),
        (lambda a: a.on_barrier(0, 1), lambda a: a.on_end_of_stream(0), "blocked"),
        (lambda a: a.on_end_of_stream(0), lambda a: a.on_barrier(0, 1), "after its end of stream"),
        (lambda a: a.on_end_of_stream(0), lambda a: a.on_end_of_stream(0), "after its end of stream"),
        (lambda a: None, lambda a: a.on_barrier(2, 1), "unknown channel 2"),
        (lambda a: None, lambda a: a.on_cancel(-1, 1), "unknown channel -1"),
    ],
)
def test_protocol_violations_raise_alignment_error(prepare, event, match):
    a = BarrierAligner(2)
    prepare(a)
    with pytest.raises(AlignmentError, match=match):
        event(a)


# ----------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Record:
    channel: int
    seq: int
    epoch: int  # 1 + number of markers sent before it on its channel


BARRIER, CANCEL, EOS = "barrier", "cancel", "eos"


@st.composite
def scenarios(draw):
    """k FIFO channels; on each, checkpoint n is usually a barrier, sometimes a cancel marker
    (upstream aborted n) or nothing (upstream skipped n); channels may end early."""
    k = draw(st.integers(1, 4))
    checkpoints = draw(st.integers(1, 4))
    channels = []
    for c in range(k):
        items = []
        seq = 0
        last = draw(st.integers(0, checkpoints)) if draw(st.booleans()) else checkpoints
        for n in range(1, last + 1):
            for _ in range(draw(st.integers(0, 2))):
                items.append(Record(c, seq, n))
                seq += 1
            marker = draw(st.sampled_from([BARRIER] * 6 + [CANCEL, None]))
            if marker is not None:
                items.append((marker, n))
        for _ in range(draw(st.integers(0, 2))):
            items.append(Record(c, seq, last + 1))
            seq += 1
        items.append((EOS,))
        channels.append(items)
    return checkpoints, channels


def run_simulation(
    checkpoints,
    channels,
    choose,
    coordinator_abort=lambda: None,
    aligner_factory=BarrierAligner,
    check_blocked_set=True,
):
    """The runtime loop: consume only from non-blocked channels; on TriggerSnapshot record
    the records consumed so far. Checks the snapshot property on every trigger."""
    k = len(channels)
    aligner = aligner_factory(k)
    queues = [deque(items) for items in channels]
    consumed_records: set = set()
    consumed_markers: list[set] = [set() for _ in range(k)]  # (kind, n) consumed per channel
    ended: set = set()
    snapshots: dict = {}
    aborts: list = []
    coordinator_aborted_before_trigger: set = set()
    end_of_input = 0

    def expected_snapshot(n):
        out = set()
        for c, items in enumerate(channels):
            for item in items:
                if item == (BARRIER, n):
                    break
                if isinstance(item, Record):
                    out.add(item)
        return out

    def handle(actions):
        nonlocal end_of_input
        for action in actions:
            if isinstance(action, TriggerSnapshot):
                n = action.checkpoint_id
                assert n not in snapshots, f"checkpoint {n} triggered twice"
                assert all(m < n for m in snapshots), "triggers out of order"
                for c in range(k):
                    assert (BARRIER, n) in consumed_markers[c] or c in ended, (
                        f"checkpoint {n} triggered before channel {c} delivered its barrier"
                    )
                snapshots[n] = frozenset(consumed_records)
                assert snapshots[n] == expected_snapshot(n), (
                    f"snapshot {n}: extra {sorted(snapshots[n] - expected_snapshot(n), key=repr)}, "
                    f"missing {sorted(expected_snapshot(n) - snapshots[n], key=repr)}"
                )
            elif isinstance(action, AbortCheckpoint):
                aborts.append(action.checkpoint_id)
            else:
                assert isinstance(action, EndOfInput)
                end_of_input += 1
                assert not any(queues)

    while any(queues):
        cid = coordinator_abort()
        if cid is not None:
            if cid not in snapshots:
                coordinator_aborted_before_trigger.add(cid)
            handle(aligner.abort(cid, "coordinator abort"))
        blocked = aligner.blocked
        # only the channels that delivered the barrier being aligned are blocked
        if not check_blocked_set:
            pass
        elif aligner.aligning is None:
            assert blocked == frozenset()
        else:
            assert blocked == {c for c in range(k) if (BARRIER, aligner.aligning) in consumed_markers[c]}
        available = [c for c in range(k) if queues[c] and c not in blocked]
        assert available, "deadlock: every channel with data is blocked"
        c = choose(available)
        item = queues[c].popleft()
        if isinstance(item, Record):
            consumed_records.add(item)
        elif item[0] == BARRIER:
            consumed_markers[c].add(item)
            handle(aligner.on_barrier(c, item[1]))
        elif item[0] == CANCEL:
            consumed_markers[c].add(item)
            handle(aligner.on_cancel(c, item[1]))
        else:
            ended.add(c)
            handle(aligner.on_end_of_stream(c))

    assert end_of_input == 1 and aligner.finished
    assert len(aborts) == len(set(aborts)), f"an abort was emitted twice: {aborts}"
    assert not set(aborts) & set(snapshots), "a checkpoint was both triggered and aborted"
    for n in range(1, checkpoints + 1):
        clean = all(
            (BARRIER, n) in items
            or not any(isinstance(i, tuple) and i[0] != EOS and i[1] >= n for i in items)
            for items in channels
        )
        some_barrier = any((BARRIER, n) in items for items in channels)
        if clean and some_barrier and n not in coordinator_aborted_before_trigger:
            assert n in snapshots, f"checkpoint {n} had every barrier but was not triggered"
    return snapshots, aborts


@settings(max_examples=300, deadline=None)
@given(scenarios(), st.data())
def test_simulated_snapshots_hold_exactly_the_records_before_their_barriers(scenario, data):
    checkpoints, channels = scenario
    run_simulation(checkpoints, channels, lambda avail: data.draw(st.sampled_from(avail)))


@settings(max_examples=200, deadline=None)
@given(scenarios(), st.data())
def test_simulation_with_coordinator_aborts(scenario, data):
    checkpoints, channels = scenario

    def coordinator_abort():
        if data.draw(st.integers(0, 9)) == 0:
            return data.draw(st.integers(1, checkpoints))
        return None

    run_simulation(checkpoints, channels, lambda avail: data.draw(st.sampled_from(avail)), coordinator_abort)


def test_simulation_newer_barrier_abort_and_cancel_abort():
    r = lambda c, s, e: Record(c, s, e)  # noqa: E731
    channels = [
        [r(0, 0, 1), (BARRIER, 1), r(0, 1, 2), (BARRIER, 2), (EOS,)],
        [r(1, 0, 1), r(1, 1, 2), (BARRIER, 2), (CANCEL, 3), (EOS,)],  # skipped 1
        [(BARRIER, 1), (BARRIER, 2), (BARRIER, 3), (EOS,)],
    ]
    snapshots, aborts = run_simulation(3, channels, lambda avail: avail[0])
    assert sorted(snapshots) == [2] and sorted(aborts) == [1, 3]
    assert snapshots[2] == {r(0, 0, 1), r(0, 1, 2), r(1, 0, 1), r(1, 1, 2)}


def test_simulation_detects_a_runtime_that_ignores_blocking():
    """The simulation's snapshot check must fail when blocking is removed."""

    class NoBlocking(BarrierAligner):
        @property
        def blocked(self):
            return frozenset()

        def _check(self, channel, what):
            pass

    channels = [
        [(BARRIER, 1), Record(0, 0, 2), (EOS,)],
        [Record(1, 0, 1), (BARRIER, 1), (EOS,)],
    ]
    order = iter([0, 0, 1, 1, 0, 1])

    def choose(avail):
        c = next(order)
        assert c in avail
        return c

    with pytest.raises(AssertionError, match=r"snapshot 1: extra \[Record\(channel=0, seq=0, epoch=2\)\]"):
        run_simulation(1, channels, choose, aligner_factory=NoBlocking, check_blocked_set=False)
    # and the same schedule (as far as blocking allows) passes with the real aligner
    run_simulation(1, channels, lambda avail: avail[-1])
