"""The input gate's bound: a channel is full at its capacity of elements, or at its share of the
gate's rows once it holds two elements (what a barrier waits behind stays short)."""
from __future__ import annotations

import threading

import pyarrow as pa
import pytest

from abs.runtime.channels import EOS, Barrier, InputGate


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


def test_a_gate_without_room_for_an_element_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="at least one element and one row"):
        InputGate(1, capacity=0)
