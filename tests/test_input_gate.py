"""The input gate's bound: a channel is full at its capacity of elements, or at its share of the
gate's rows once it holds two elements (what a barrier waits behind stays short)."""
from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from abs.runtime.channels import EOS, WAKE_AT, Barrier, InputGate


def rows(n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_arrays([pa.array(range(n))], names=["value"])


def test_a_channel_is_full_at_its_share_of_the_rows_once_it_holds_two_elements():
    gate = InputGate(2, capacity=8, rows=200)  # 100 rows a channel
    gate.put(0, rows(150))
    assert gate.has_room(0), "one element always leaves room for a second"
    gate.put(0, rows(10))
    assert not gate.has_room(0) and gate.has_room(1)
    assert gate.fill() == pytest.approx(0.5)
    channel, item = gate.take(frozenset(), 0)
    assert channel == 0 and item.num_rows == 150
    assert gate.has_room(0)


def test_small_batches_fill_a_channel_by_count_and_markers_carry_no_rows():
    gate = InputGate(1, capacity=3, rows=1_000)
    gate.put(0, rows(1))
    gate.put(0, Barrier(1))
    assert gate.has_room(0)
    gate.put(0, rows(1))
    assert not gate.has_room(0)


def test_a_sender_waiting_for_room_goes_on_once_the_rows_are_taken():
    gate = InputGate(1, capacity=8, rows=100)
    gate.put(0, rows(60))
    gate.put(0, rows(60))
    done = threading.Event()

    def send() -> None:
        gate.put(0, EOS)
        done.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert not gate.has_room(0)  # the sender waits (or is about to) for room for a third element
    channel, item = gate.take(frozenset(), 1.0)
    assert channel == 0 and item.num_rows == 60
    assert done.wait(10), "the take made room but the sender was not woken"
    sender.join(10)
    assert [gate.take(frozenset(), 0)[1].num_rows, gate.take(frozenset(), 0)[1]] == [60, EOS]


def test_a_waiting_sender_is_woken_once_its_channel_is_down_to_wake_at_elements_not_at_each_take():
    capacity = WAKE_AT + 3
    gate = InputGate(1, capacity=capacity, rows=1_000_000)
    for i in range(capacity):
        gate.put(0, rows(i + 1))
    waiting, done = threading.Event(), threading.Event()
    wait = gate._cond.wait

    def noted_wait(*args) -> bool:
        waiting.set()  # the sender is about to wait: the lock is still held, so no take comes between
        return wait(*args)

    gate._cond.wait = noted_wait

    def send() -> None:
        gate.put(0, EOS)
        done.set()

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    assert waiting.wait(10), "the sender never waited for room in a full channel"
    gate._cond.wait = wait
    taken = []
    while len(gate._queues[0]) > WAKE_AT + 1:
        taken.append(gate.take(frozenset(), 0)[1].num_rows)
        assert not done.is_set() and gate._sender_waits[0], "the sender was woken above WAKE_AT elements"
    taken.append(gate.take(frozenset(), 0)[1].num_rows)  # down to WAKE_AT: the sender is woken
    assert done.wait(10), "the channel held WAKE_AT elements but the sender was not woken"
    sender.join(10)
    while True:
        got = gate.take(frozenset(), 0)
        if got is None:
            break
        taken.append(got[1] if got[1] is EOS else got[1].num_rows)
    assert taken == [*range(1, capacity + 1), EOS]


def test_a_gate_without_room_for_an_element_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="at least one element and one row"):
        InputGate(1, capacity=0)
