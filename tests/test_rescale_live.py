"""Live rescale (JobHandle.rescale): workers join and leave a running keyed counting job while
records flow, with and without checkpoints (the job and its exactness check are those of
tests/test_reconfig_live.py: each key's emitted counts must be 1..n once each).

The sources hold at a gate until the test opens it, so the job is still running, with records
flowing, while it is rescaled; the sources' splits that a leaving worker read are read to
their end by the worker they were handed to.
"""
from __future__ import annotations

import collections
import os
import signal
import threading
import time

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import abs
from abs.faults import Fault
from abs.keygroups import key_group
from abs.reconfig import Assignment
from abs.reconfig.plan import rescale_target
from abs.runtime.messages import SourceExhausted
from abs.runtime.plan import task_key
from storage import SnapshotStore
from pacing import PacedSource
from processes import killed_process
from test_reconfig_live import HOLD, M, NUM_KEYS, TOTAL, check_counts, count_fn, counting_flow, run_through_a_crash


def _final_state(root: str, cid: int) -> dict:
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(cid)
    got: dict = {}
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        keys = t.column("key").to_pylist()
        assert not set(keys) & set(got), f"key group {kg} repeats keys"
        got.update(zip(keys, t.column("value").to_pylist()))
    return got


def _ends_exact(job: abs.JobHandle, workers: int) -> None:
    """The job (its sources' gate open) finishes on ``workers`` workers with every count exact."""
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == workers
    check_counts(result.collected("out"))


def test_grow_without_storage_keeps_every_count_exact(tmp_path):
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2)
    try:
        rec = job.rescale(3)
        assert rec.status == "COMPLETED" and rec.kind == "rescale"
        assert job.assignment() == rescale_target(Assignment.initial(M, 2), 3)
        assert all(job.assignment().key_groups_of(w) for w in range(3))
        assert rec.steps[0].key_groups, "the join step carries the first moves"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == 3
    assert result.records_in["count"] == TOTAL
    check_counts(result.collected("out"))
    # the four source splits evened out at the join (2 + 2 -> 2 + 1 + 1): the new worker read
    # the rest of one of them (the old owner read its start), and every record once (above)
    assert 0 < job._driver._records[2]["src"] <= TOTAL // 4


def test_reconfiguration_and_rescale_notices_carry_the_abs_prefix_of_the_other_runtime_lines(tmp_path, caplog):
    """The driver's notices of a live reconfiguration (its start, its end, workers joining and
    leaving) read "[abs] job 'NAME': ...", as its restore and restart notices do."""
    gate = str(tmp_path / "gate")
    with caplog.at_level("INFO", logger="abs"):
        job = abs.submit(counting_flow(gate), parallelism=2)
        try:
            assert job.rescale(3).status == "COMPLETED" and job.rescale(2).status == "COMPLETED"
        finally:
            open(gate, "w").close()
        _ends_exact(job, 2)
    notices = [r.getMessage() for r in caplog.records
               if r.name in ("abs.runtime.reconfigure", "abs.runtime.rescale") and r.levelname == "INFO"]
    for part in ("reconfiguration 1 (rescale", "reconfiguration 1 done in", "workers 2..2 joined",
                 "reconfiguration 2 (rescale", "workers 2..2 left"):
        assert any(part in n for n in notices), (part, notices)
    assert all(n.startswith("[abs] job 'live-counts': ") for n in notices), notices


@pytest.mark.parametrize("strategy,batch", [("all_at_once", None), ("batched", 3), ("fluid", None)])
def test_grow_then_shrink_with_checkpoints_is_exact(tmp_path, strategy, batch):
    """2 -> 3 -> 1 workers while checkpoints run every 50 ms: the output, the final checkpoint
    (every key's count once) and the assignment each manifest records are exact; the splits of
    the workers that left are read to their end by the worker that took them over."""
    gate = str(tmp_path / "gate")
    root = str(tmp_path / "root")
    job = abs.submit(counting_flow(gate), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1))
    try:
        job.trigger_checkpoint()
        grown = job.rescale(3, strategy=strategy, batch=batch)
        assert grown.status == "COMPLETED"
        after_grow = job.trigger_checkpoint()
        shrunk = job.rescale(1, strategy=strategy, batch=batch)
        assert shrunk.status == "COMPLETED"
        assert [s for s in shrunk.steps if not s.key_groups], "drain and retire steps move no key group"
        assert job.assignment() == Assignment.initial(M, 1)
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and not result.failed_checkpoints and result.parallelism == 1
    assert result.records_in == {"src": TOTAL, "count": TOTAL, "out": TOTAL}
    check_counts(result.collected("out"))
    assert _final_state(root, result.last_checkpoint) == dict(collections.Counter(i % NUM_KEYS for i in range(TOTAL)))
    store = SnapshotStore.open(root)
    if after_grow in store.list_checkpoints():
        assert store.read_manifest(after_grow).assignment == rescale_target(Assignment.initial(M, 2), 3).owners


@pytest.mark.parametrize("before,after", [(1, 2), (2, 1)])
def test_one_to_two_and_back(tmp_path, before, after):
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=before, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1))
    try:
        assert job.rescale(after).status == "COMPLETED"
        assert job.assignment() == Assignment.initial(M, after)
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == after
    check_counts(result.collected("out"))


def test_a_joined_worker_keeps_the_key_groups_of_each_keyed_operator_apart(tmp_path):
    """Two keyed operators after one source (a count and an aggregate): a joining worker gains
    the same key groups for each, and installs and hands them over one operator at a time. Its
    operators once shared one set of owned key groups: the aggregate's install of a key group
    the count had installed failed the job ("arrived at a subtask that already owns it")."""
    gate = str(tmp_path / "gate")
    flow = abs.Dataflow("live-counts-two", max_parallelism=M)
    src = abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=4, batch_size=50, rate=4000)
    keyed = flow.source("src", PacedSource(src, TOTAL, gate=gate, hold_per_split=HOLD // 4)).key_by("key")
    keyed.process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
    keyed.aggregate("agg", {"c": ("value", "count")}).sink("aout", abs.CollectSink())
    job = abs.submit(flow, parallelism=1)
    try:
        assert job.rescale(2).status == "COMPLETED"
        # worker 1 gives one key group back: each of its operators hands its own state over
        gained = job.assignment().key_groups_of(1)[0]
        assert job.move([gained], to=0).status == "COMPLETED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == 2
    check_counts(result.collected("out"))
    final: dict = {}
    agg = result.collected("aout")
    for k, c in zip(agg.column("key").to_pylist(), agg.column("c").to_pylist()):
        final[k] = max(final.get(k, 0), c)
    assert final == dict(collections.Counter(i % NUM_KEYS for i in range(TOTAL)))


def test_workers_join_again_after_others_left(tmp_path):
    """2 -> 1 -> 3: the workers that join after a shrink get the indexes (and the peers) of
    the workers that are there, not of those that left."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2)
    try:
        assert job.rescale(1).status == "COMPLETED"
        assert job.rescale(3).status == "COMPLETED"
        assert job.assignment() == rescale_target(Assignment.initial(M, 1), 3)
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == 3
    check_counts(result.collected("out"))


def test_a_restore_after_a_rescale_continues_at_the_new_parallelism(tmp_path):
    """A job grown to 3 workers ends; a new run restores its last checkpoint at 3 workers (each
    key group at its default owner, whoever wrote it): its sources resume at their ends, so it
    emits nothing again, and its own final checkpoint holds every key's count once."""
    gate = str(tmp_path / "gate")
    root = str(tmp_path / "root")
    job = abs.submit(counting_flow(gate), parallelism=2, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=2))
    try:
        job.rescale(3, strategy="batched", batch=4)
    finally:
        open(gate, "w").close()
    first = job.wait(timeout=300)
    assert SnapshotStore.open(root).read_manifest(first.last_checkpoint).assignment == job.assignment().owners
    open(tmp_path / "gate2", "w").close()
    again = abs.run(counting_flow(str(tmp_path / "gate2")), parallelism=3, storage=root, restore="latest",
                    checkpoint=abs.CheckpointConfig(interval=0.5, retained=2))
    assert again.restored_from == first.last_checkpoint and again.last_checkpoint > first.last_checkpoint
    assert again.collected("out").num_rows == 0
    assert _final_state(root, again.last_checkpoint) == dict(collections.Counter(i % NUM_KEYS for i in range(TOTAL)))


def test_bad_rescale_requests_are_refused_and_change_nothing(tmp_path):
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2)
    try:
        for workers, match in [(2, "runs 2 workers already"), (0, r"int in \[1, 16\]"), (M + 1, "max_parallelism=16"),
                               ("3", "must be an int"), (3.0, "must be an int")]:
            with pytest.raises(abs.ReconfigurationError, match=match):
                job.rescale(workers)
        with pytest.raises(abs.ReconfigurationError, match="batch=N"):
            job.rescale(3, strategy="batched")
        assert job.assignment() == Assignment.initial(M, 2) and job.reconfigurations() == []
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.parallelism == 2
    check_counts(result.collected("out"))


class _NoFourthWorker(abs.LocalExecutor):
    """Starts no worker of index 3 or more (a join that fails before its first step)."""

    def launch(self, index, boot):
        if index >= 3:
            raise OSError(f"worker {index}: no room for it (a test's executor)")
        return super().launch(index, boot)


def test_a_join_that_did_not_start_keeps_the_counts_of_relayed_splits(tmp_path):
    """A rescale whose new workers do not start changes nothing, and forgets nothing of the
    earlier rescales: the driver still knows how many split handovers it relayed to each
    source task (it once forgot them: an end of input that a source reported before a later
    handover's splits reached it would have been taken for its end, and the job finished
    without reading them)."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2, executor=_NoFourthWorker())
    try:
        assert job.rescale(3).status == "COMPLETED"
        driver = job._driver
        (joined,) = [task_key(t.index, 2) for t in driver.plan.tasks if t.is_source]
        assert driver._splits_relayed[joined] == 1, "the join hands one split to the new worker"
        with pytest.raises(abs.ReconfigurationError, match="did not start.*nothing was changed"):
            job.rescale(4)
        assert driver.is_stale_exhaustion(SourceExhausted(joined, splits_gained=0))
        assert not driver.is_stale_exhaustion(SourceExhausted(joined, splits_gained=1))
        assert job.rescale(2).status == "COMPLETED"
    finally:
        open(gate, "w").close()
    _ends_exact(job, 2)

class _JoiningWorkerDiesBeforeItConnects(abs.LocalExecutor):
    """Worker 2 is a process killed (SIGKILL) before it could connect to the driver."""

    def launch(self, index, boot):
        if index == 2:
            return killed_process()
        return super().launch(index, boot)


def test_a_joining_worker_lost_before_it_connects_leaves_no_thread_behind(tmp_path, monkeypatch):
    """The join accepted the new workers' connections in a thread that stayed blocked in
    accept() on the closed listener for the process's life when a new worker died before it
    connected (one thread and one listening port per failed join). The join is refused, the
    job runs on exactly, and nothing of the join is left."""
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2, executor=_JoiningWorkerDiesBeforeItConnects())
    before = set(threading.enumerate())
    try:
        with pytest.raises(abs.ReconfigurationError, match=r"did not start .*worker 2 .*signal 9.*nothing was changed"):
            job.rescale(3)
        left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        assert not left, left
    finally:
        open(gate, "w").close()
    _ends_exact(job, 2)
    assert not raised, raised


class _KillsWorkerZeroAtTheJoin(abs.LocalExecutor):
    """Before it starts worker 2 it kills worker 0 of the running job (SIGKILL) and waits until
    that process is dead: a worker of the job is lost while the new one starts."""

    def __init__(self) -> None:
        super().__init__()
        self.procs: dict = {}

    def launch(self, index, boot):
        if index == 2:
            pid = self.procs[0].pid
            os.kill(pid, signal.SIGKILL)
            while _state(pid) not in ("Z", None):  # dead (a zombie until the driver reaps it)
                time.sleep(0.01)
        proc = self.procs[index] = super().launch(index, boot)
        return proc


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_a_worker_of_the_job_lost_while_new_workers_start_is_named_as_such(tmp_path):
    """The join's failure once blamed the new workers ("the new workers did not start
    (WorkerLostError: ... worker 0 ...); nothing was changed") when it was worker 0 of the
    running job that died; the job then restarts from its latest checkpoint, exactly."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2, executor=_KillsWorkerZeroAtTheJoin(),
                     storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.05, retained=1),
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1))
    try:
        with pytest.raises(abs.ReconfigurationError,
                           match=r"a worker of the job was lost while the new workers started: .*worker 0 \(pid"):
            job.rescale(3)
        assert job.reconfigurations()[0].status == "FAILED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == 2 and len(result.restarts) == 1
    check_counts(result.collected("out"))


class _StopsWorkerOneAtTheJoin(abs.LocalExecutor):
    """Before it starts worker 2 it stops worker 1 of the running job (SIGSTOP: alive, but it
    sends nothing) and waits until that process is stopped: a worker of the job hangs while
    the new one starts (the new one then cannot connect to it either)."""

    def __init__(self) -> None:
        super().__init__()
        self.procs: dict = {}

    def launch(self, index, boot):
        if index == 2:
            pid = self.procs[1].pid
            os.kill(pid, signal.SIGSTOP)
            while _state(pid) not in ("T", "t", None):
                time.sleep(0.01)
        proc = self.procs[index] = super().launch(index, boot)
        return proc


def test_a_worker_of_the_job_that_hangs_while_new_workers_start_is_found_by_its_heartbeat(tmp_path):
    """The join waited on the new workers alone: a running worker that hung meanwhile was found
    only when the others gave up connecting to it (60 s: "the channels of joining workers ...
    did not connect"). The driver now reads the running workers while it waits, and the
    heartbeat timeout finds the hung one, as in the message loop; the job restarts, exactly."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=2, executor=_StopsWorkerOneAtTheJoin(),
                     storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.05, retained=1),
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
                     runtime=abs.RuntimeOptions(heartbeat_timeout=2.0))
    try:
        with pytest.raises(abs.ReconfigurationError,
                           match=r"worker 1 sent nothing for \d+ s while new workers started \(heartbeat timeout\)"):
            job.rescale(3)
        assert job.reconfigurations()[0].status == "FAILED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and result.parallelism == 2 and len(result.restarts) == 1
    assert "heartbeat timeout" in result.restarts[0]["error"]
    check_counts(result.collected("out"))


# ----------------------------------------------------------------------------- schedules
ops = st.lists(st.one_of(
    st.tuples(st.just("rescale"), st.integers(1, 4), st.sampled_from(["all_at_once", "batched", "fluid"])),
    st.tuples(st.just("move"), st.sets(st.integers(0, M - 1), min_size=1, max_size=6),
              st.sampled_from(["all_at_once", "fluid"])),
), min_size=1, max_size=3)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedule=ops, checkpoints=st.booleans())
# schedules that once let the input run out before the test was done (the sources' hold was
# per reader, and a rescale hands splits to new readers: now it is per split)
@example(schedule=[("move", {6, 7, 9, 10, 11, 15}, "all_at_once"), ("rescale", 4, "fluid"), ("rescale", 4, "fluid")],
         checkpoints=True)
@example(schedule=[("move", {6, 7, 9, 10, 11, 15}, "all_at_once"), ("rescale", 1, "batched"),
                   ("rescale", 4, "fluid")], checkpoints=True)
# a worker index that left and joins again: its new source task's end once looked stale for
# ever (the driver counted the splits relayed to the index, not to the task), and the job hung
@example(schedule=[("rescale", 3, "all_at_once"), ("rescale", 2, "fluid"), ("rescale", 3, "all_at_once")],
         checkpoints=False)
# a drain step that waits for nothing (the leaving worker read no split; no checkpoints) once
# stayed running when the retire step started: the job failed ("step 2 still runs")
@example(schedule=[("rescale", 5, "batched"), ("rescale", 4, "all_at_once")], checkpoints=False)
def test_any_schedule_of_rescales_and_moves_gives_the_output_of_a_run_without_them(tmp_path_factory, schedule,
                                                                                   checkpoints):
    tmp = tmp_path_factory.mktemp("schedule")
    gate = str(tmp / "gate")
    options = dict(storage=str(tmp / "root"), checkpoint=abs.CheckpointConfig(interval=0.05, retained=1)) \
        if checkpoints else {}
    job = abs.submit(counting_flow(gate), parallelism=2, **options)
    workers = 2
    try:
        for op in schedule:
            if op[0] == "rescale":
                _kind, n, strategy = op
                batch = 3 if strategy == "batched" else None
                if n == workers:
                    with pytest.raises(abs.ReconfigurationError, match="already"):
                        job.rescale(n, strategy=strategy, batch=batch)
                    continue
                want = rescale_target(job.assignment(), n)
                assert job.rescale(n, strategy=strategy, batch=batch).status == "COMPLETED"
                assert job.assignment() == want
                workers = n
            else:
                _kind, kgs, strategy = op
                to = max(kgs) % workers
                if all(job.assignment().owners[kg] == to for kg in kgs):
                    continue
                assert job.move(sorted(kgs), to=to, strategy=strategy).status == "COMPLETED"
    finally:
        open(gate, "w").close()
    result = job.wait(timeout=300)
    assert result.status == "FINISHED" and not result.failed_checkpoints and result.parallelism == workers
    check_counts(result.collected("out"))


# ----------------------------------------------------------------------------- crashes
@pytest.mark.parametrize("before,after,fault", [
    (2, 3, Fault("after_connect", "task0#2", nth=1)),  # the joining worker dies while it connects
    (2, 3, Fault("after_routing_switch", "task1#2", nth=1)),  # a joined worker dies at the join step
    (3, 2, Fault("during_split_handover", "*", nth=1)),  # a leaving source dies handing its splits over
    (3, 2, Fault("before_retire", "*", nth=1)),  # a leaving source dies at the retire step
])
def test_a_kill_during_a_rescale_restores_exactly(tmp_path, before, after, fault):
    """A worker is killed (SIGKILL) at a point of the rescale; the job restores its latest
    checkpoint and its output is exact."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), parallelism=before, storage=str(tmp_path / "root"),
                     checkpoint=abs.CheckpointConfig(interval=0.05, retained=1),
                     restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
                     runtime=abs.RuntimeOptions(faults=(fault,)))
    run_through_a_crash(job, gate, lambda: job.rescale(after), ("restarted", "failed while they connected", "ended"))


def test_key_groups_of_counted_keys():
    """The counting job's keys cover several key groups of every worker (else a rescale would
    move empty key groups only and prove little)."""
    kgs = {key_group(k, M) for k in range(NUM_KEYS)}
    for workers in (1, 2, 3, 4):
        owners = rescale_target(Assignment.initial(M, 2), workers).owners
        assert all(any(owners[kg] == w for kg in kgs) for w in range(workers))


# ----------------------------------------------------------------------------- on Spark
def test_rescale_on_the_spark_executor(tmp_path, spark):
    """On Spark the job's first workers are one barrier stage (its size is fixed once
    submitted); a joining worker runs as a Spark job of its own with one barrier task, and a
    leaving worker's task ends when its worker stops."""
    gate = str(tmp_path / "gate")
    job = abs.submit(counting_flow(gate), executor=abs.SparkExecutor(spark, num_workers=2),
                     storage=str(tmp_path / "root"), checkpoint=abs.CheckpointConfig(interval=0.1, retained=1))
    try:
        job.trigger_checkpoint()
        assert job.rescale(3, strategy="batched", batch=3).status == "COMPLETED"
        with pytest.raises(abs.ReconfigurationError, match="free task slot"):
            job.rescale(6)  # local[4]: one slot is left
        assert job.rescale(2).status == "COMPLETED"
    finally:
        open(gate, "w").close()
    _ends_exact(job, 2)
