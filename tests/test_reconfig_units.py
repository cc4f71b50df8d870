"""The pure parts of live reconfiguration (abs.reconfig): plans, step alignment, holding, the
driver's step bookkeeping, and the routing switch of an exchange."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.dataflow import KEY_BY
from abs.errors import ReconfigurationError
from abs.keygroups import key_groups
from abs.reconfig import Assignment, plan_steps
from abs.reconfig.aligner import StepAligner, StepOrderError
from abs.reconfig.coordinator import Reconfiguration
from abs.reconfig.holding import Holding
from abs.reconfig.plan import move_target, plan_rescale, rebalance_target
from abs.runtime.channels import StepMarker
from abs.runtime.plan import OutputPlan
from abs.runtime.task import ExchangeWriter

M = 16


# ----------------------------------------------------------------------------- plans
@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 6), data=st.data())
def test_plans_turn_the_assignment_into_the_target(p, data):
    current = Assignment(tuple(data.draw(st.lists(st.integers(0, p - 1), min_size=M, max_size=M))), p)
    target = Assignment(tuple(data.draw(st.lists(st.integers(0, p - 1), min_size=M, max_size=M))), p)
    strategy = data.draw(st.sampled_from(["all_at_once", "batched", "fluid"]))
    batch = data.draw(st.integers(1, 5)) if strategy == "batched" else None
    steps = plan_steps(current, target, strategy, batch)
    a = current
    moved = []
    for i, step in enumerate(steps):
        assert step.index == i + 1 and step.moves
        if strategy == "fluid":
            assert len(step.moves) == 1
        elif strategy == "batched":
            assert len(step.moves) <= batch
        a = a.applied(step.moves)
        moved += step.key_groups
    assert a == target
    assert sorted(moved) == [kg for kg in range(M) if current.owners[kg] != target.owners[kg]]
    assert len(moved) == len(set(moved))  # each key group moves once
    if strategy == "all_at_once":
        assert len(steps) <= 1


def test_requests_are_checked_against_the_assignment():
    a = Assignment.initial(M, 2)
    assert move_target(a, [0, 15], 1).owners[0] == 1
    with pytest.raises(ReconfigurationError, match="key group 16 does not exist"):
        move_target(a, [16], 0)
    with pytest.raises(ReconfigurationError, match="to=2 is not a worker"):
        move_target(a, [1], 2)
    with pytest.raises(ReconfigurationError, match="name at least one"):
        move_target(a, [], 1)
    with pytest.raises(ReconfigurationError, match="one worker per key group"):
        rebalance_target(a, [0] * 3)
    assert rebalance_target(a, {3: 1}).owners[3] == 1
    assert a.describe() == "w0: 0-7; w1: 8-15"


def test_numpy_integers_name_key_groups_and_workers_and_other_values_are_named_as_not_ids():
    """Key groups picked from an array (np.argsort of their load, np.flatnonzero, ...) are
    numpy integers: they were refused as "key group np.int64(3) does not exist" (and a worker
    np.int64(1) as "not a worker"), which it does, and is."""
    a = Assignment.initial(M, 2)
    assert move_target(a, np.array([0, 3]), np.int64(1)).owners[:4] == (1, 0, 0, 1)
    assert move_target(a, [np.int32(9)], 0).owners[9] == 0
    assert rebalance_target(a, {np.int64(3): np.int64(1)}).owners[3] == 1
    assert all(type(w) is int for w in move_target(a, np.array([0, 3]), np.int64(1)).owners)
    for bad in (True, 1.0, "1", None):
        with pytest.raises(ReconfigurationError, match=r"is not a key group id: key groups are ints 0 \.\. 15"):
            move_target(a, [bad], 1)
    with pytest.raises(ReconfigurationError, match="key group np.int64\\(16\\) does not exist"):
        move_target(a, [np.int64(16)], 1)
    with pytest.raises(ReconfigurationError, match="to=True is not a worker"):
        move_target(a, [1], True)


# ----------------------------------------------------------------------------- alignment
def test_a_step_aligns_when_every_live_channel_delivered_it():
    al = StepAligner(3)
    assert not al.on_marker(0, 1) and al.blocked == {0}
    assert not al.on_marker(2, 1) and al.blocked == {0, 2}
    assert al.on_end_of_stream(1)  # the last channel missing ended: aligned
    assert al.blocked == frozenset() and al.last_aligned == 1
    assert al.on_marker(0, 2) is False and al.on_marker(2, 2) is True
    with pytest.raises(StepOrderError):
        al.on_marker(0, 2)  # a step again


def test_markers_out_of_order_are_a_bug():
    al = StepAligner(2)
    al.on_marker(0, 3)
    with pytest.raises(StepOrderError):
        al.on_marker(1, 4)
    with pytest.raises(StepOrderError):
        al.on_marker(0, 3)


# ----------------------------------------------------------------------------- holding
def test_held_rows_come_out_per_key_group_in_arrival_order():
    h = Holding(M)
    h.hold(3)
    batch1 = pa.record_batch({"x": [1, 2, 3, 4]})
    rest = h.split(batch1, np.array([3, 5, 3, 7]))
    assert rest.column("x").to_pylist() == [2, 4]
    assert h.split(pa.record_batch({"x": [5]}), np.array([3])) is None
    h.hold(7)
    assert h.split(pa.record_batch({"x": [6, 7]}), np.array([7, 3])) is None
    assert [b.column("x").to_pylist() for b in h.release(3)] == [[1, 3], [5], [7]]
    assert [b.column("x").to_pylist() for b in h.release(7)] == [[6]]
    assert not h and h.rows == 0


# ----------------------------------------------------------------------------- driver bookkeeping
def test_a_step_completes_when_every_operator_installed_every_key_group():
    a = Assignment.initial(M, 2)
    target = move_target(a, [0, 1], 1)
    steps = plan_steps(a, target, "fluid")
    r = Reconfiguration(1, "move", "fluid", a, target, steps, ["op1", "op2"], 7, clock=lambda: 0.0)
    sid, step = r.start_next()
    assert sid == 7 and step.key_groups == (0,)
    assert not r.on_installed("op1", 0, 0)
    with pytest.raises(RuntimeError):
        r.on_installed("op1", 1, 0)  # not this step's
    assert r.on_installed("op2", 0, 10) and r.assignment.owners[0] == 1 and not r.done
    sid, step = r.start_next()
    assert sid == 8 and step.key_groups == (1,)
    r.on_installed("op1", 1, 0)
    assert r.on_installed("op2", 1, 0) and r.done and r.record.status == "COMPLETED"
    assert r.assignment == target and r.record.steps[0].bytes_read == 10


def test_a_step_that_waits_for_nothing_completes_at_once():
    """A rescale's drain step of workers that read no split, in a job that does not
    checkpoint, waits for no event: the driver completes it as it starts it, and the next
    step can start (it once found the drain step still running: the job failed)."""
    a = Assignment.initial(M, 3)
    target, steps = plan_rescale(a, 2, "all_at_once", None)
    r = Reconfiguration(1, "rescale", "all_at_once", a, target, steps, ["op"], 1, clock=lambda: 0.0)
    _sid, moves = r.start_next()
    assert not r.complete_idle(), "the moves' installs are awaited"
    assert [r.on_installed("op", kg, 0) for kg in moves.key_groups][-1]
    _sid, drain = r.start_next()
    assert drain.phase == "drain" and r.idle
    assert r.complete_idle() and not r.idle
    _sid, retire = r.start_next()
    assert retire.phase == "retire"
    r.expect(("done", "task0#2"))
    assert not r.complete_idle()
    assert r.on_event(("done", "task0#2")) and r.done and r.assignment == target

# ----------------------------------------------------------------------------- routing switch
class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def send(self, item):
        self.log.append((self.name, item))


def _batch(keys):
    return pa.record_batch({"key": pa.array(keys, pa.int64())})


def test_the_routing_switches_exactly_at_the_marker():
    """Every record of a moving key group emitted before the marker reaches its old owner
    before the marker; every record after reaches the new owner after it."""
    log: list = []
    senders = [_Recorder(log, 0), _Recorder(log, 1)]
    out = OutputPlan(from_node=0, target_task=1, target_node=1, edge_index=0, partition=KEY_BY, key="key")
    routing = np.array([kg * 2 // M for kg in range(M)], dtype=np.int64)
    w = ExchangeWriter(out, senders, routing, M, "count")
    keys = list(range(200))
    kgs = key_groups(np.array(keys), M)
    moving = {kg for kg in range(M // 2)}  # worker 0's key groups go to worker 1
    w(_batch(keys))
    marker = StepMarker(1, tuple((kg, 1) for kg in sorted(moving)))
    w.switch(marker)
    w(_batch(keys))
    assert routing[0] == 0  # the writer keeps its own copy of the table

    def rows(name, before):
        seen_marker = False
        got = []
        for n, item in log:
            if n != name:
                continue
            if isinstance(item, StepMarker):
                seen_marker = True
                continue
            if seen_marker != before:
                got += item.column("key").to_pylist()
        return got, seen_marker

    before0, m0 = rows(0, True)
    after0, _ = rows(0, False)
    before1, m1 = rows(1, True)
    after1, _ = rows(1, False)
    assert m0 and m1  # the marker went to both channels
    moving_keys = {k for k, g in zip(keys, kgs) if g in moving}
    assert moving_keys and moving_keys <= set(before0)  # before the marker: the old owner
    assert not moving_keys & set(after0)  # after it: never the old owner
    assert moving_keys <= set(after1) and not moving_keys & set(before1)
    assert sorted(after1) == keys  # worker 1 owns every key group after the step


# ----------------------------------------------------------------------------- manifests
def test_a_manifest_records_the_assignment_and_refuses_a_malformed_one():
    import json

    from storage import Manifest
    from storage.errors import CorruptManifestError

    owners = tuple([1] * 8 + [0] * 8)
    m = Manifest(checkpoint_id=3, job_name="j", max_parallelism=M, assignment=owners)
    back = Manifest.from_json(m.to_json())
    assert back.assignment == owners
    assert Manifest.from_json(Manifest(checkpoint_id=3, job_name="j", max_parallelism=M).to_json()).assignment is None
    doc = json.loads(m.to_json())
    doc.pop("checksum", None), doc.pop("checksum_algorithm", None)
    doc["assignment"] = [0] * 3
    with pytest.raises(CorruptManifestError, match="assignment is not a list of 16 subtask indexes"):
        Manifest.from_dict(doc)
