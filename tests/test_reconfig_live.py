"""Live reconfiguration of running jobs (abs.reconfig): key groups move between the workers of
a keyed counting job while records flow, with and without checkpoints.

Every record increments its key's count and emits it, so the output tells exactly what
happened: each key's emitted counts must be 1..n once each (a record processed twice, or at
an owner without the key's state, repeats a count; a lost record leaves a gap), and n must be
the key's number of records.
"""
from __future__ import annotations

import collections

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import abs
import abs.reconfig.plan
from abscore.ids import id_ranges
from abs.keygroups import key_group
from abs.faults import Fault
from abs.reconfig import Assignment
from storage import SnapshotStore
from pacing import PacedSource

M = 16
NUM_KEYS = 101
TOTAL = 24_000
HOLD = 10_000  # records read before the sources hold until the gate opens (HOLD / 4 per split)


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def counting_flow(gate: str) -> abs.Dataflow:
    flow = abs.Dataflow("live-counts", max_parallelism=M)
    src = abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=4, batch_size=50, rate=4000)
    # every split stops at HOLD / 4 records until the test opens the gate, whichever reader reads
    # it (a rescale hands splits to new readers): the job is still running (and records are
    # still flowing until then) while the test reconfigures it
    src = PacedSource(src, TOTAL, gate=gate, hold_per_split=HOLD // 4)
    flow.source("src", src).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    return flow


def check_counts(table: pa.Table) -> None:
    per_key = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    want = collections.Counter(i % NUM_KEYS for i in range(TOTAL))
    assert set(per_key) == set(want)
    for k, counts in per_key.items():
        assert sorted(counts) == list(range(1, want[k] + 1)), f"key {k} (key group {key_group(k, M)})"


def _reconfigure(job) -> None:
    first = job.move([0, 1, 2, 3], to=1)
    assert first.status == "COMPLETED" and first.key_groups == (0, 1, 2, 3)
    assert len(first.steps) == 1
    owners = job.assignment().owners
    assert [owners[kg] for kg in range(4)] == [1, 1, 1, 1]
    fluid = job.move([12, 13, 14], to=0, strategy="fluid")
    assert [s.key_groups for s in fluid.steps] == [(12,), (13,), (14,)]
    batched = job.rebalance({0: 0, 1: 0, 9: 0, 12: 1, 5: 1}, strategy="batched", batch=2)
    assert len(batched.steps) == 3
    assert job.assignment().owners[9] == 0 and job.assignment().owners[5] == 1
    assert [r.id for r in job.reconfigurations()] == [1, 2, 3]


def test_moves_without_storage_keep_every_count_exact(tmp_path):
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2)
    try:
        _reconfigure(job)
        recs = job.reconfigurations()
        assert all(s.full_handovers == 1 * len(s.key_groups) for r in recs for s in r.steps)
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    check_counts(result.collected("out"))


def test_moves_during_checkpoints_keep_every_count_and_checkpoint_exact(tmp_path):
    gate = str(tmp_path / "gate")
    root = str(tmp_path / "root")
    job = abs.submit(counting_flow(gate), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1))
    try:
        job.trigger_checkpoint()
        _reconfigure(job)
        recs = job.reconfigurations()
        deltas = [s for r in recs for s in r.steps if s.full_handovers < len(s.key_groups)]
        assert deltas, "at least one handover built on a checkpoint"
        job.trigger_checkpoint()
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and not result.failed_checkpoints
    check_counts(result.collected("out"))
    # the last checkpoint holds every key's final count once
    store = SnapshotStore.open(root)
    cid = result.last_checkpoint
    manifest = store.read_manifest(cid)
    got = {}
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        got.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert got == dict(collections.Counter(i % NUM_KEYS for i in range(TOTAL)))
    # its manifest records where each key group was, and abs-snapshot show says so
    assert manifest.assignment == job.assignment().owners != Assignment.initial(M, 2).owners
    from storage.inspect import show_lines

    line = next(x for x in show_lines(manifest) if x.startswith("key-group assignment"))
    assert line == ("key-group assignment (moved by live reconfiguration): "
                    f"subtask 0: {id_ranges(job.assignment().key_groups_of(0), sep=',')}; "
                    f"subtask 1: {id_ranges(job.assignment().key_groups_of(1), sep=',')}")


def test_bad_requests_are_refused_and_change_nothing(tmp_path):
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2)
    try:
        before = job.assignment()
        assert before == Assignment.initial(M, 2)
        with pytest.raises(abs.ReconfigurationError, match="key group 99 does not exist"):
            job.move([99], to=0)
        with pytest.raises(abs.ReconfigurationError, match="to=5 is not a worker"):
            job.move([1], to=5)
        with pytest.raises(abs.ReconfigurationError, match="batch=N"):
            job.move([1], to=1, strategy="batched")
        with pytest.raises(abs.ReconfigurationError, match="not a reconfiguration strategy"):
            job.move([1], to=1, strategy="slowly")
        with pytest.raises(abs.ReconfigurationError, match="nothing to move"):
            job.move([0], to=0)
        with pytest.raises(abs.ReconfigurationError, match="one worker per key group"):
            job.rebalance([0, 1])
        # once a bare TypeError ("'NoneType' object is not iterable") from list(None)
        with pytest.raises(abs.ReconfigurationError, match=r"key_groups must be a key group id or an iterable"):
            job.move(None, to=1)
        # a str is an iterable of characters: it asked for key groups '1' and '2'
        with pytest.raises(abs.ReconfigurationError, match=r"key_groups must be a key group id or an iterable"):
            job.move("12", to=1)
        assert job.assignment() == before and job.reconfigurations() == []
    finally:
        open(gate, "w").close()
    check_counts(job.wait(timeout=300).collected("out"))


def test_reconfiguring_a_job_that_ended_is_refused_as_such(tmp_path):
    """A finished or canceled job is a request that cannot be carried out: README promises a
    ReconfigurationError for it (as for a job whose input has ended while it runs). It was a
    JobFailedError ("job ... is not running (FINISHED)") that named no way on, and one a
    caller catching ReconfigurationError around its rescales did not catch."""
    gate = str(tmp_path / "gate")
    open(gate, "w").close()
    job = abs.submit(counting_flow(gate), parallelism=2)
    assert job.wait(timeout=300).status == "FINISHED"
    for call in (lambda: job.move([1], to=0), lambda: job.rebalance({1: 0}), lambda: job.rescale(3)):
        with pytest.raises(abs.ReconfigurationError, match=r"is not running \(FINISHED\); its input has ended"):
            call()
    held = abs.submit(counting_flow(str(tmp_path / "never")), parallelism=2, storage=str(tmp_path / "root"),
                      checkpoint=abs.CheckpointConfig(interval=0.05))
    held.trigger_checkpoint()
    assert held.cancel().status == "CANCELED"
    with pytest.raises(abs.ReconfigurationError, match=r"not running \(CANCELED\); .*restore='latest'"):
        held.rescale(3)
    assert held.reconfigurations() == []


def recount_fn(ctx, row):
    seen = ctx.state.seen
    n = (seen.value() or 0) + 1
    seen.update(n)
    ctx.emit({"key": ctx.key, "count": row["count"], "seen": n})


def test_two_keyed_stages_move_together(tmp_path):
    """A key group moves in every keyed operator: the second stage (fed by the first through
    another key_by) hands over and installs its own state at the same step."""
    gate = str(tmp_path / "gate")
    flow = abs.Dataflow("two-stages", max_parallelism=M)
    src = PacedSource(abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=4, batch_size=50, rate=4000),
                      TOTAL, gate=gate, hold_per_split=HOLD // 4)
    (flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())])
         .key_by("key").process("recount", recount_fn, state=[abs.ValueState("seen", pa.int64())])
         .sink("out", abs.CollectSink()))
    job = abs.submit(flow, parallelism=2, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1))
    try:
        job.trigger_checkpoint()
        rec = job.move(range(0, M, 2), to=1, strategy="batched", batch=3)
        assert rec.status == "COMPLETED"
        job.rebalance(list(Assignment.initial(M, 2).owners), strategy="fluid")  # and back
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    out = result.collected("out")
    check_counts(out)
    # the second stage counted each key's records itself: the same count, record for record
    assert out.column("seen").to_pylist() == out.column("count").to_pylist()


def test_a_checkpoint_during_a_step_waits_for_the_key_groups_on_their_way(tmp_path):
    """Every read of a state file takes a second, so the new owner's installs are slow; a
    checkpoint triggered right after the step starts reaches the new owner while its key
    groups are on their way. It must wait for them: a snapshot taken before would hold them
    nowhere (the old owner has released them), and every checkpoint must hold every key group."""
    import threading
    import time

    gate = str(tmp_path / "gate")
    opts = {"target_protocol": "file",
            "faults": [{"op": "read", "action": "delay", "seconds": 1.0, "times": None, "path_glob": "*/state/*"}]}
    job = abs.submit(counting_flow(gate), parallelism=2, storage=f"faulty://{tmp_path}/root", storage_options=opts,
                     checkpoint=abs.CheckpointConfig(interval=None, retained=100))
    moved: list = []
    try:
        deadline = time.monotonic() + 120  # bounds a hang only
        while job.metrics()["records_in"].get("count", 0) < 2_000:  # every key group holds state
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first = job.trigger_checkpoint()
        mover = threading.Thread(target=lambda: moved.append(job.move(range(8), to=1)))
        mover.start()
        deadline = time.monotonic() + 120  # bounds a hang only
        while not (job.reconfigurations() and job.reconfigurations()[0].steps):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        during = job.trigger_checkpoint()
        mover.join(timeout=300)
        assert moved and moved[0].status == "COMPLETED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    check_counts(result.collected("out"))
    store = SnapshotStore.open(str(tmp_path / "root"))
    every = sorted({key_group(k, M) for k in range(NUM_KEYS)})  # the key groups holding a key
    for cid in store.list_checkpoints():
        if cid >= first:
            assert sorted(store.read_manifest(cid).keyed["count"]["n"]) == every, cid
    assert during in store.list_checkpoints()


# ----------------------------------------------------------------------------- schedules
schedules = st.lists(
    st.tuples(st.sets(st.integers(0, M - 1), min_size=1, max_size=M), st.integers(0, 1),
              st.sampled_from(["all_at_once", "batched", "fluid"])),
    min_size=1, max_size=3)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=schedules, checkpoints=st.booleans())
def test_any_schedule_of_moves_gives_the_output_of_a_run_without_them(tmp_path_factory, schedule, checkpoints):
    tmp = tmp_path_factory.mktemp("schedule")
    gate = str(tmp / "gate")
    options = dict(storage=str(tmp / "root"), checkpoint=abs.CheckpointConfig(interval=0.05, retained=1)) \
        if checkpoints else {}
    job = abs.submit(counting_flow(gate), parallelism=2, **options)
    expected = Assignment.initial(M, 2)
    try:
        for kgs, to, strategy in schedule:
            target = abs.reconfig.plan.move_target(expected, kgs, to)
            if target == expected:
                with pytest.raises(abs.ReconfigurationError, match="nothing to move"):
                    job.move(sorted(kgs), to=to, strategy=strategy, batch=2 if strategy == "batched" else None)
                continue
            rec = job.move(sorted(kgs), to=to, strategy=strategy, batch=2 if strategy == "batched" else None)
            assert rec.status == "COMPLETED"
            expected = target
            assert job.assignment() == expected
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and not result.failed_checkpoints
    check_counts(result.collected("out"))


# ----------------------------------------------------------------------------- crashes
def run_through_a_crash(job, gate: str, request, causes: tuple) -> None:
    """Ask for a reconfiguration while a fault kills a worker: the call fails with one of
    ``causes`` (or meets the attempt's end), the job restarts once and its output is exact."""
    try:
        job.trigger_checkpoint()
        try:
            request()
        except abs.ReconfigurationError as exc:
            assert any(why in str(exc) for why in causes), exc
        except abs.JobFailedError:
            pass  # the request met the attempt's end
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and len(result.restarts) == 1
    check_counts(result.collected("out"))


@pytest.mark.parametrize("point", ["after_routing_switch", "before_handover", "during_transfer", "before_install",
                                   "after_install"])
def test_a_kill_during_a_reconfiguration_restores_exactly(tmp_path, point):
    """A worker is killed (SIGKILL) at ``point`` of the first handover; the job restores the
    latest checkpoint (every key group at its default owner) and its output and final
    checkpoint are exact."""
    gate = str(tmp_path / "gate")
    root = str(tmp_path / "root")
    job = abs.submit(counting_flow(gate), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1),
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=(Fault(point, "*", nth=1),)))
    run_through_a_crash(job, gate, lambda: job.move(range(8), to=1), ("restarted", "ended"))
    recs = job.reconfigurations()
    assert recs and recs[0].status == "FAILED" and "restarted" in recs[0].error
    assert job.assignment() == Assignment.initial(M, 2)


# ----------------------------------------------------------------------------- on Spark
def test_moves_on_the_spark_executor(tmp_path, spark):
    """The workers of a Spark barrier stage move key groups the same way (channels between
    Spark tasks, the driver's connections to them)."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), executor=abs.SparkExecutor(spark, num_workers=2),
                     storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.1, retained=1))
    try:
        job.trigger_checkpoint()
        rec = job.move(range(8), to=1, strategy="batched", batch=3)
        assert rec.status == "COMPLETED" and len(rec.steps) == 3
        assert job.assignment().key_groups_of(0) == ()
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED"
    check_counts(result.collected("out"))
