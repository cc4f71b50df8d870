"""A source's key_by writer coalesces small slices per channel (abs.runtime.exchange): every
channel must carry the same records between the same control elements, in the same order,
as without coalescing: no record crosses a barrier, a step marker or the end of stream."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.dataflow import KEY_BY
from abs.runtime.channels import EOS, Barrier, InputGate, LocalSender, StepMarker
from abs.runtime.exchange import COALESCE_ROWS, ExchangeWriter
from abs.runtime.plan import OutputPlan

M = 16  # key groups

items = st.lists(st.one_of(
    st.tuples(st.just("batch"), st.integers(1, 3 * COALESCE_ROWS // 2), st.integers(0, 2**31)),
    st.tuples(st.just("barrier"), st.integers(1, 10**6), st.just(0)),
    st.tuples(st.just("move"), st.integers(0, M - 1), st.integers(0, 3)),
    st.tuples(st.just("idle"), st.just(0), st.just(0)),
), min_size=1, max_size=25)


def _writer(p: int, routing: np.ndarray) -> tuple[ExchangeWriter, list[InputGate]]:
    gates = [InputGate(1, capacity=10**9, rows=10**12) for _ in range(p)]
    out = OutputPlan(from_node=0, target_task=1, target_node=1, edge_index=0, partition=KEY_BY, key="key")
    return ExchangeWriter(out, [LocalSender(g, 0) for g in gates], routing.copy(), M, "t"), gates


def _drain(gate: InputGate) -> list:
    """The channel's elements, its batches' keys merged between control elements."""
    got: list = []
    rows: list = []
    while True:
        taken = gate.take(frozenset(), 0)
        if taken is None:
            break
        item = taken[1]
        if isinstance(item, pa.RecordBatch):
            rows += item.column("seq").to_pylist()
            continue
        got += [tuple(rows), repr(item)]
        rows = []
    return got + [tuple(rows)]


@settings(max_examples=60, deadline=None)
@given(p=st.integers(2, 4), owners=st.lists(st.integers(0, 3), min_size=M, max_size=M), schedule=items)
def test_coalescing_keeps_every_record_between_the_same_control_elements(p, owners, schedule):
    routing = np.array([o % p for o in owners], np.int64)
    plain, plain_gates = _writer(p, routing)
    held, held_gates = _writer(p, routing)
    held.enable_coalescing()
    seq = 0
    for kind, a, b in schedule:
        for w in (plain, held):
            if kind == "batch":
                keys = np.random.default_rng(b).integers(0, 1000, a)
                w(pa.RecordBatch.from_arrays([pa.array(keys), pa.array(np.arange(seq, seq + a))], names=["key", "seq"]))
            elif kind == "barrier":
                w.send_all(Barrier(a, 0))
            elif kind == "move":
                w.switch(StepMarker(a, ((a, b % p),), 0, 0, "move"))
            else:
                w.flush()  # what a source task does before it waits for input
        if kind == "batch":
            seq += a
    for w in (plain, held):
        w.send_all(EOS)
    sent = sum(s.sent for s in held.senders)
    assert sent <= sum(s.sent for s in plain.senders)
    for g_plain, g_held in zip(plain_gates, held_gates):
        assert _drain(g_held) == _drain(g_plain)


def test_small_slices_go_out_as_one_batch_once_they_reach_the_threshold():
    routing = np.array([0] * 8 + [1] * 8, np.int64)
    w, gates = _writer(2, routing)
    w.enable_coalescing()
    rows = 0
    while rows < 4 * COALESCE_ROWS:
        keys = np.arange(rows, rows + 1000) % 997
        w(pa.RecordBatch.from_arrays([pa.array(keys), pa.array(np.arange(rows, rows + 1000))], names=["key", "seq"]))
        rows += 1000
    w.send_all(EOS)
    for g in gates:
        sizes = []
        while (taken := g.take(frozenset(), 0)) is not None:
            if isinstance(taken[1], pa.RecordBatch):
                sizes.append(taken[1].num_rows)
        assert sizes and all(n >= COALESCE_ROWS for n in sizes[:-1]), sizes  # ~500-row slices, merged
