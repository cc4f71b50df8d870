"""Checkpoint coordinator core and CheckpointConfig, driven by a manual clock."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from abs.config import CheckpointConfig
from abs.coordinator import (
    Abort,
    CheckpointCoordinator,
    Commit,
    FailJob,
    NotifyComplete,
    PendingCheckpoint,
    Trigger,
    TriggerPolicy,
)
from abs.errors import ConfigError

TASKS = ("src#0", "map#0", "map#1")


class ManualClock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def make(first_id=1, tasks=TASKS, **config):
    clock = ManualClock()
    return CheckpointCoordinator(CheckpointConfig(**config), tasks, first_id, clock), clock


def triggers(actions):
    return [a.checkpoint_id for a in actions if isinstance(a, Trigger)]


def ack_all(coord, cid, tasks=TASKS):
    out = []
    for t in tasks:
        out += coord.on_ack(cid, t, {"files": [f"{t}-{cid}"]})
    return out


def complete(coord, cid, tasks=TASKS):
    actions = ack_all(coord, cid, tasks)
    assert [type(a) for a in actions] == [Commit]
    return coord.on_committed(cid)


# ----------------------------------------------------------------------------- config


def test_config_defaults():
    c = CheckpointConfig()
    assert (c.interval, c.timeout, c.min_pause, c.max_concurrent, c.retained, c.mode, c.tolerable_failures) == (
        None, 600.0, 0.0, 1, 3, "aligned", None
    )
    CheckpointConfig(interval=0.5, timeout=1, min_pause=0, max_concurrent=4, retained=1, tolerable_failures=0)
    CheckpointConfig(mode="stop_the_world")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.interval = 1.0


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"interval": 0}, "interval"),
        ({"interval": -1.0}, "interval"),
        ({"interval": float("inf")}, "interval"),
        ({"interval": True}, "interval"),
        ({"interval": "1s"}, "interval"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": None}, "timeout"),
        ({"min_pause": -0.1}, "min_pause"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"max_concurrent": 1.0}, "max_concurrent"),
        ({"retained": 0}, "retained"),
        ({"mode": "sideways"}, "mode"),
        ({"mode": "stop_the_world", "max_concurrent": 2}, "max_concurrent"),
        ({"tolerable_failures": -1}, "tolerable_failures"),
        ({"tolerable_failures": 1.5}, "tolerable_failures"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"CheckpointConfig\.{field} must"):
        CheckpointConfig(**kwargs)


def test_coordinator_arguments_are_validated():
    with pytest.raises(ConfigError, match="first_id must be an int >= 1"):
        CheckpointCoordinator(CheckpointConfig(), TASKS, 0, ManualClock())
    with pytest.raises(ConfigError, match="needs a CheckpointConfig"):
        CheckpointCoordinator({"interval": 1}, TASKS, 1, ManualClock())
    coord, _ = make()
    with pytest.raises(ConfigError, match="'checkpoint' or 'savepoint'"):
        coord.request("backup")


# ----------------------------------------------------------------------------- policy


def test_trigger_policy_pure_decisions():
    p = TriggerPolicy(CheckpointConfig(interval=10, min_pause=3, max_concurrent=4))
    assert p.capacity == 1  # min_pause forces one at a time
    assert not p.may_trigger_periodic(now=9, in_flight=0, last_trigger=0, last_end=None)
    assert p.may_trigger_periodic(now=10, in_flight=0, last_trigger=0, last_end=None)
    assert not p.may_trigger_periodic(now=10, in_flight=1, last_trigger=0, last_end=None)
    assert not p.may_trigger_periodic(now=10, in_flight=0, last_trigger=0, last_end=8)
    assert p.may_trigger_periodic(now=11, in_flight=0, last_trigger=0, last_end=8)
    assert p.next_wakeup(0, last_trigger=0, last_end=8) == 11
    assert p.next_wakeup(1, last_trigger=0, last_end=8) is None
    q = TriggerPolicy(CheckpointConfig(max_concurrent=2))
    assert q.capacity == 2 and q.periodic_due_at(5) is None and q.may_trigger_request(1)
    assert not q.may_trigger_request(2)


def test_pending_checkpoint_tracks_acks():
    p = PendingCheckpoint(3, "checkpoint", 1.0, frozenset({"a", "b"}))
    assert not p.ack("a", 1, 2.0)
    assert not p.ack("a", 99, 2.5)  # repeated: ignored
    assert not p.ack("zzz", 1, 2.5)  # not expected: ignored
    assert p.missing == {"b"}
    assert p.ack("b", 2, 3.0)
    assert p.acks == {"a": 1, "b": 2} and p.acked_at == 3.0 and p.missing == frozenset()


# ----------------------------------------------------------------------------- periodic


def test_interval_triggers_periodically_once_the_previous_one_is_done():
    coord, clock = make(interval=10)
    assert coord.tick() == []
    clock.advance(9.9)
    assert coord.tick() == []
    clock.advance(0.1)
    actions = coord.tick()
    assert actions == [Trigger(1, "checkpoint", 110.0)]
    clock.advance(10)
    assert coord.tick() == []  # max_concurrent=1: 1 is still in flight
    clock.advance(2)
    complete(coord, 1)
    assert triggers(coord.tick()) == [2]  # overdue: triggers at once
    complete(coord, 2)
    clock.advance(9)
    assert coord.tick() == []
    clock.advance(1)
    assert triggers(coord.tick()) == [3]


def test_no_periodic_checkpoints_without_interval():
    coord, clock = make()
    for _ in range(5):
        clock.advance(1000)
        assert coord.tick() == []


def test_timeout_aborts_and_late_acks_do_not_resurrect():
    coord, clock = make(interval=1, timeout=5)
    clock.advance(1)
    assert triggers(coord.tick()) == [1]
    coord.on_ack(1, "src#0", "p")
    clock.advance(4.9)
    assert coord.tick() == []
    clock.advance(0.1)
    actions = coord.tick()
    assert isinstance(actions[0], Abort) and actions[0].checkpoint_id == 1
    assert "timeout after 5 s" in actions[0].reason and "map#0, map#1" in actions[0].reason
    assert triggers(actions) == [2]  # the freed slot is used at once (interval long past)
    assert coord.on_ack(1, "map#0", "p") == [] and coord.on_ack(1, "map#1", "p") == []
    assert coord.pending_ids() == (2,)
    (failed,) = coord.failed
    assert (failed.checkpoint_id, failed.triggered_at, failed.ended_at, failed.duration) == (1, 101.0, 106.0, 5.0)
    assert failed.reason.startswith("timeout")


def test_min_pause_delays_the_next_periodic_trigger():
    coord, clock = make(interval=2, min_pause=5, max_concurrent=3)
    clock.advance(2)
    assert triggers(coord.tick()) == [1]
    clock.advance(1)
    assert coord.tick() == []  # min_pause > 0: one at a time
    complete(coord, 1)  # ends at 103
    clock.advance(4.9)
    assert coord.tick() == []
    clock.advance(0.1)
    assert triggers(coord.tick()) == [2]
    # an abort ends a checkpoint too
    clock.advance(1)
    coord.on_decline(2, "map#0", "no space")
    clock.advance(4.9)
    assert coord.tick() == []
    clock.advance(0.1)
    assert triggers(coord.tick()) == [3]


@pytest.mark.parametrize("max_concurrent", [1, 2])
def test_max_concurrent(max_concurrent):
    coord, clock = make(interval=1, max_concurrent=max_concurrent)
    started = []
    for _ in range(5):
        clock.advance(1)
        started += triggers(coord.tick())
    assert started == list(range(1, max_concurrent + 1))
    assert len(coord.pending_ids()) == max_concurrent
    complete(coord, 1)
    clock.advance(1)
    assert triggers(coord.tick()) == [max_concurrent + 1]


def test_next_deadline():
    coord, clock = make(interval=10, timeout=3)
    assert coord.next_deadline() == 110.0
    clock.advance(10)
    coord.tick()
    assert coord.next_deadline() == 113.0  # timeout of 1; no capacity for a periodic one
    coord2, _ = make()
    assert coord2.next_deadline() is None


# ----------------------------------------------------------------------------- on request


def test_request_triggers_at_once_bypassing_interval_and_min_pause():
    coord, clock = make(min_pause=100)
    assert coord.request() == 1
    assert coord.tick() == [Trigger(1, "checkpoint", 100.0)]
    complete(coord, 1)
    assert coord.request("savepoint") == 2  # min_pause does not apply to requests
    assert coord.tick() == [Trigger(2, "savepoint", 100.0)]


def test_requests_queue_behind_max_concurrent_and_go_before_periodic():
    coord, clock = make(interval=1, max_concurrent=1)
    clock.advance(1)
    assert triggers(coord.tick()) == [1]
    assert coord.request("savepoint") is None
    assert coord.queued_id() == 2
    assert coord.request() is None
    assert coord.queued_id() == 3 and coord.queued_requests() == 2
    clock.advance(5)
    assert coord.tick() == []
    complete(coord, 1)
    actions = coord.tick()
    assert actions == [Trigger(2, "savepoint", 106.0)]
    complete(coord, 2)
    assert coord.tick() == [Trigger(3, "checkpoint", 106.0)]  # the queued request, not a periodic one
    assert coord.queued_id() is None


def test_requests_wait_while_no_task_is_expected():
    coord, clock = make(tasks=("a",), interval=1)
    coord.on_task_finished("a")
    assert coord.request() is None
    clock.advance(10)
    assert coord.tick() == []


# ----------------------------------------------------------------------------- ids


def test_ids_start_at_first_id_increase_and_are_never_reused():
    coord, clock = make(first_id=42, interval=1, timeout=2)
    seen = []
    for step in range(12):
        clock.advance(1)
        for a in coord.tick():
            if isinstance(a, Trigger):
                seen.append(a.checkpoint_id)
        if step % 3 == 0 and coord.pending_ids():
            coord.on_decline(coord.pending_ids()[0], "map#0", "test")
    assert seen[0] == 42
    assert seen == sorted(set(seen)) and seen == list(range(42, 42 + len(seen)))
    # restart: a new coordinator from the storage's next id continues above every id used
    restarted, _ = make(first_id=coord.next_id)
    assert restarted.request() == seen[-1] + 1


# ----------------------------------------------------------------------------- acks and commit


def test_commit_after_all_acks_then_notify_complete():
    coord, clock = make()
    coord.request()
    coord.tick()
    clock.advance(1)
    assert coord.on_ack(1, "src#0", "a") == []
    assert coord.on_ack(1, "src#0", "again") == []  # duplicate ignored
    assert coord.on_ack(1, "stranger#9", "x") == []  # not expected: ignored
    assert coord.on_ack(1, "map#0", "b") == []
    clock.advance(1)
    (commit,) = coord.on_ack(1, "map#1", "c")
    assert commit == Commit(1, {"src#0": "a", "map#0": "b", "map#1": "c"}, 100.0, 102.0, "checkpoint")
    assert coord.on_ack(1, "map#1", "late") == []
    clock.advance(0.5)
    assert coord.on_committed(1) == [NotifyComplete(1)]
    assert coord.pending_ids() == ()
    (rec,) = coord.completed
    assert (rec.checkpoint_id, rec.triggered_at, rec.acked_at, rec.ended_at, rec.duration, rec.reason) == (
        1, 100.0, 102.0, 102.5, 2.5, None
    )
    assert coord.on_committed(1) == []  # unknown now


def test_acks_for_unknown_ids_are_ignored():
    coord, _ = make()
    assert coord.on_ack(7, "src#0", "x") == []
    assert coord.on_decline(7, "src#0", "x") == []
    assert coord.on_commit_failed(7, "x") == []


def test_decline_aborts_and_later_acks_are_ignored():
    coord, _ = make()
    coord.request()
    coord.tick()
    coord.on_ack(1, "src#0", "a")
    assert coord.on_decline(1, "map#1", "newer barrier 2") == [Abort(1, "declined by map#1: newer barrier 2")]
    assert coord.on_ack(1, "map#0", "b") == [] and coord.on_ack(1, "map#1", "c") == []
    assert coord.on_decline(1, "map#0", "again") == []
    assert [r.checkpoint_id for r in coord.failed] == [1] and coord.completed == []


def test_commit_failure_aborts():
    coord, _ = make()
    coord.request()
    coord.tick()
    ack_all(coord, 1)
    assert coord.on_commit_failed(1, "OSError: disk full") == [Abort(1, "commit failed: OSError: disk full")]
    assert coord.pending_ids() == () and coord.on_committed(1) == []


def test_committing_checkpoints_do_not_time_out_and_survive_task_failures():
    coord, clock = make(timeout=5)
    coord.request()
    coord.tick()
    ack_all(coord, 1)
    clock.advance(100)
    assert coord.tick() == []
    assert coord.on_task_failed("map#0") == []
    assert coord.on_committed(1) == [NotifyComplete(1)]


def test_completion_subsumes_older_pending_checkpoints_but_not_savepoints():
    coord, clock = make(max_concurrent=4)
    for kind in ("checkpoint", "savepoint", "checkpoint", "checkpoint"):
        coord.request(kind)
    assert triggers(coord.tick()) == [1, 2, 3, 4]
    actions = complete(coord, 3)
    assert actions == [NotifyComplete(3), Abort(1, "subsumed by checkpoint 3")]
    assert coord.pending_ids() == (2, 4)
    assert complete(coord, 2) == []  # completed, but older than 3: no notification
    assert [r.checkpoint_id for r in coord.completed] == [3, 2]
    assert complete(coord, 4) == [NotifyComplete(4)]


def test_task_failure_aborts_every_pending_checkpoint():
    coord, _ = make(max_concurrent=2)
    coord.request()
    coord.request()
    coord.tick()
    assert coord.on_task_failed("map#1") == [Abort(1, "task failed: map#1"), Abort(2, "task failed: map#1")]
    assert coord.pending_ids() == ()


def test_finished_tasks_are_not_expected_by_later_checkpoints():
    coord, _ = make(max_concurrent=2)
    coord.request()
    coord.tick()
    coord.on_task_finished("src#0")
    assert coord.expected_tasks == {"map#0", "map#1"}
    coord.request()
    coord.tick()
    assert ack_all(coord, 2, ("map#0", "map#1"))[0].checkpoint_id == 2
    assert ack_all(coord, 1, ("map#0", "map#1")) == []  # 1 still waits for src#0
    assert coord.on_ack(1, "src#0", "final")[0].checkpoint_id == 1


def test_tolerable_failures():
    coord, clock = make(tolerable_failures=1, timeout=1)
    coord.request()
    coord.tick()
    assert coord.on_decline(1, "map#0", "x") == [Abort(1, "declined by map#0: x")]
    coord.request()
    coord.tick()
    actions = coord.on_decline(2, "map#0", "y")
    assert actions[0] == Abort(2, "declined by map#0: y")
    assert isinstance(actions[1], FailJob) and "2 consecutive checkpoint failures" in actions[1].reason
    coord.request()
    coord.tick()
    clock.advance(1)
    assert [type(a) for a in coord.tick()] == [Abort]  # FailJob only once


def test_completion_resets_the_failure_count():
    coord, clock = make(tolerable_failures=2)
    for cid in (1, 2, 3, 4, 5, 6):
        coord.request()
        coord.tick()
        if cid == 3:
            complete(coord, cid)
            continue
        actions = coord.on_decline(cid, "map#0", "x")
        assert any(isinstance(a, FailJob) for a in actions) == (cid == 6), cid


def test_subsumption_and_task_failures_do_not_count_as_failures():
    coord, _ = make(tolerable_failures=0, max_concurrent=2)
    coord.request()
    coord.request()
    coord.tick()
    assert complete(coord, 2) == [NotifyComplete(2), Abort(1, "subsumed by checkpoint 2")]
    coord.request()
    coord.tick()
    assert coord.on_task_failed("map#0") == [Abort(3, "task failed: map#0")]


# ----------------------------------------------------------------------------- random runs


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 3),
    st.sampled_from([None, 1.0, 3.0]),
    st.sampled_from([0.0, 2.0]),
    st.lists(
        st.tuples(st.sampled_from(["tick", "ack", "decline", "commit", "commit_fail", "request", "task_failed"]),
                  st.integers(0, 5), st.floats(0, 4)),
        max_size=40,
    ),
)
def test_random_event_sequences_keep_the_invariants(max_concurrent, interval, min_pause, events):
    coord, clock = make(first_id=10, interval=interval, min_pause=min_pause, max_concurrent=max_concurrent, timeout=6)
    capacity = 1 if min_pause else max_concurrent
    triggered, ended, committing = [], set(), set()

    def handle(actions):
        for a in actions:
            if isinstance(a, Trigger):
                assert not triggered or a.checkpoint_id == triggered[-1] + 1
                triggered.append(a.checkpoint_id)
            elif isinstance(a, Abort):
                assert a.checkpoint_id in triggered and a.checkpoint_id not in ended
                assert a.checkpoint_id not in committing
                ended.add(a.checkpoint_id)
            elif isinstance(a, Commit):
                assert a.checkpoint_id not in ended and set(a.acks) == set(TASKS)
                committing.add(a.checkpoint_id)
            elif isinstance(a, NotifyComplete):
                assert a.checkpoint_id in ended  # recorded as ended by on_committed below

    for kind, i, dt in events:
        clock.advance(dt)
        pending = coord.pending_ids()
        target = pending[i % len(pending)] if pending else 10 + i
        if kind == "tick":
            handle(coord.tick())
        elif kind == "ack":
            for t in TASKS[: 1 + i % 3]:
                handle(coord.on_ack(target, t, i))
        elif kind == "decline":
            handle(coord.on_decline(target, TASKS[i % 3], "r"))
        elif kind == "commit":
            if target in committing and target not in ended:
                ended.add(target)
                committing.discard(target)
                handle(coord.on_committed(target))
        elif kind == "commit_fail":
            if target in committing and target not in ended:
                committing.discard(target)
                handle(coord.on_commit_failed(target, "boom"))
        elif kind == "request":
            handle(coord.tick() if coord.request() is not None else [])
        else:
            handle(coord.on_task_failed(TASKS[i % 3]))
        assert len(coord.pending_ids()) <= capacity
        assert set(coord.pending_ids()) == set(triggered) - ended
    finished = [r.checkpoint_id for r in coord.completed + coord.failed]
    assert len(finished) == len(set(finished)) and set(finished) == ended


def test_periodic_checkpoints_wait_while_a_reconfiguration_step_runs():
    coord, clock = make(interval=1.0)
    clock.advance(1.0)
    assert triggers(coord.tick()) == [1]
    complete(coord, 1)
    coord.defer_periodic = True
    clock.advance(5.0)
    assert triggers(coord.tick()) == []  # due, but a step is in flight
    assert coord.request() == 2  # an explicit request still goes
    assert triggers(coord.tick()) == [2]
    complete(coord, 2)
    clock.advance(5.0)
    coord.defer_periodic = False
    assert triggers(coord.tick()) == [3]
