"""Crash tests: a real SIGKILL (or SIGSTOP) of a worker at each named fault point, global
failover from the latest complete checkpoint, and output that equals a run without
failures: no record lost, none duplicated (two-phase-commit file sink)."""
from __future__ import annotations

import collections
import os
import threading

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.faults import Fault
from abs.connectors.file_sink import FileSink, read_output
from pacing import PacedSource
from processes import killed_process
from recovery import NoUsableCheckpointError
from storage import JobMismatchError, SnapshotStore, StorageUnavailableError
from storage.testing import Fault as StorageFault

pytestmark = pytest.mark.integration

TOTAL, KEYS = 24_000, 200


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def flow(out: str, paced: bool = True) -> abs.Dataflow:
    f = abs.Dataflow("crash")
    # paced: each source reader emits at most 1,500 of its 12,000 records per completed
    # checkpoint, so fault points after the 2nd or 3rd checkpoint are reached on any machine
    # (a job none of whose checkpoints can complete needs an unpaced source to end)
    src: abs.Source = abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=4, batch_size=200)
    if paced:
        src = PacedSource(src, 1_500)
    f.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink(
        "out", FileSink(out, format="parquet")
    )
    return f


def assert_exactly_once(out: str) -> None:
    table = read_output(out, "parquet")
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter((np.arange(TOTAL) % KEYS).tolist())
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in expected.items()}


def run_with(tmp_path, *faults: Fault, restarts: int = 2, storage: str | None = None, paced: bool = True,
             storage_options: dict | None = None, **runtime_options) -> abs.JobResult:
    out = str(tmp_path / "out")
    result = abs.run(
        flow(out, paced),
        parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.25, retained=2),
        storage=storage or str(tmp_path / "snap"), storage_options=storage_options,
        restart=abs.RestartStrategy(max_restarts=restarts, delay=0.1),
        runtime=abs.RuntimeOptions(faults=faults, **runtime_options),
    )
    assert result.status == "FINISHED"
    assert_exactly_once(out)
    assert SnapshotStore.open(str(tmp_path / "snap")).verify().ok
    return result


@pytest.mark.parametrize(
    "fault",
    [
        Fault("records", "task1#0", nth=4_000),
        Fault("during_alignment", "task1#1", nth=2),
        Fault("after_sync_snapshot", "task1#0", nth=2),
        Fault("after_barrier_forward", "task0#1", nth=3),
        Fault("during_upload", "task1#1", nth=20),
        Fault("before_ack", "task0#0", nth=2),
        Fault("before_commit", "task1#1", nth=2),
        Fault("after_commit", "task1#0", nth=2),
        Fault("sink_commit", "task1#1", nth=2),
    ],
    ids=lambda f: f.point,
)
def test_kill_9_at_fault_point_recovers_with_exact_output(tmp_path, fault):
    result = run_with(tmp_path, fault)
    assert len(result.restarts) == 1
    assert "signal 9" in result.restarts[0]["error"]


def test_kill_9_during_the_restore_itself(tmp_path):
    result = run_with(
        tmp_path,
        Fault("after_sync_snapshot", "task1#0", nth=3),
        Fault("restore", "task1#1", nth=1, attempt=1),
        restarts=3,
    )
    assert len(result.restarts) == 2
    assert result.restarts[0]["restored_from"] is not None


def test_hung_worker_is_detected_by_heartbeat_and_replaced(tmp_path):
    result = run_with(tmp_path, Fault("records", "task1#1", nth=3_000, action="hang"), heartbeat_timeout=3.0)
    assert len(result.restarts) == 1
    assert "heartbeat" in result.restarts[0]["error"]


@pytest.mark.parametrize(
    "faults",
    [
        (Fault("after_connect", "task0#1", action="hang"),),
        (Fault("after_sync_snapshot", "task1#0", nth=3), Fault("restore", "task1#1", nth=1, attempt=1, action="hang")),
    ],
    ids=["hung-after-connecting", "hung-while-restoring"],
)
def test_a_worker_hung_while_starting_is_found_by_heartbeat_not_the_startup_timeout(tmp_path, faults):
    # a starting worker sends heartbeats: a hung one is replaced after heartbeat_timeout,
    # not after the startup timeout (120 s), which restoring a large state may need
    result = run_with(tmp_path, *faults, restarts=3, heartbeat_timeout=3.0)
    hung = result.restarts[-1]["error"]
    assert "while starting" in hung and "heartbeat" in hung, hung


def test_without_restarts_the_failure_names_the_worker_and_advises_the_restore(tmp_path):
    with pytest.raises(abs.WorkerLostError, match=r"worker 1 .*signal 9.*gave up after 0 restart.*restore='latest'"):
        abs.run(flow(str(tmp_path / "out")), parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.25),
                storage=str(tmp_path / "snap"), runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#1", nth=500)]))


def fails_at_once(ctx, row):
    raise ValueError("bad record")


def test_a_job_that_gave_up_before_any_checkpoint_does_not_advise_restore_latest(tmp_path):
    """Without a checkpoint in the root, the advice 'run it again with restore=latest to
    continue from its latest complete checkpoint' led to a refused restore ('holds no
    checkpoint'), and for a run that started from a savepoint it left the savepoint behind."""
    def failing() -> abs.Dataflow:
        f = abs.Dataflow("crash")
        # more records per split than flow()'s: a restore of its savepoint still has records to fail on
        f.source("src", abs.GeneratorSource(2 * TOTAL, num_keys=KEYS, num_splits=4, batch_size=200)).key_by("key").process(
            "count", fails_at_once, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        return f

    root = str(tmp_path / "snap")
    with pytest.raises(abs.OperatorError) as err:
        abs.run(failing(), parallelism=2, storage=root)
    assert "bad record" in str(err.value) and "gave up after 0 restart" in str(err.value)
    assert "continue from its latest complete checkpoint" not in str(err.value), str(err.value)
    assert "holds no complete checkpoint yet, so restore='latest' would find nothing: run it again as before" in str(err.value)
    with pytest.raises(NoUsableCheckpointError, match="holds no checkpoint"):
        abs.run(failing(), parallelism=2, storage=root, restore="latest")  # what the old advice led to

    # a run that started from a savepoint elsewhere: run it again from the savepoint
    first = abs.run(flow(str(tmp_path / "out"), paced=False), parallelism=2, storage=str(tmp_path / "a"))
    savepoint = str(tmp_path / "sp")
    SnapshotStore.open(str(tmp_path / "a")).savepoint(first.last_checkpoint, savepoint)
    with pytest.raises(abs.OperatorError) as err:
        abs.run(failing(), parallelism=2, storage=str(tmp_path / "b"), restore=savepoint, allow_non_restored_state=True)
    assert f"no checkpoint of this run completed; run it again with restore={savepoint!r} as before" in str(err.value)


def test_storage_write_failures_fail_only_that_checkpoint_and_the_job_goes_on(tmp_path):
    out = str(tmp_path / "out")
    root = str(tmp_path / "snap")
    result = abs.run(
        flow(out),
        parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.25, retained=50),
        storage=f"faulty://{root}",
        # in every worker, the 3rd and 4th state-file writes fail, then one is torn
        storage_options={"target_protocol": "file", "faults": [
            {"op": "write", "nth": 3, "times": 2, "path_glob": "*/state/*"},
            {"op": "write", "nth": 9, "action": "tear", "path_glob": "*/state/*"},
        ]},
    )
    assert result.status == "FINISHED" and not result.restarts
    assert result.failed_checkpoints, "the injected write failures must fail some checkpoint"
    assert any("upload failed" in reason for _cid, reason in result.failed_checkpoints)
    failed_ids = {cid for cid, _r in result.failed_checkpoints}
    completed = [c.checkpoint_id for c in result.completed_checkpoints]
    assert any(c > min(failed_ids) for c in completed), "a later checkpoint must succeed"
    store = SnapshotStore.open(root)
    assert not failed_ids & set(store.list_checkpoints())
    assert store.verify().ok
    assert_exactly_once(out)
    final = {}
    manifest = store.read_manifest(store.latest_checkpoint())
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        final.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    assert final == dict(collections.Counter((np.arange(TOTAL) % KEYS).tolist()))


# ----------------------------------------------------------------------------- starting and restarting
@pytest.mark.parametrize(
    "faults",
    [
        (Fault("before_connect", "task0#1"),),
        (Fault("after_connect", "task0#0"),),
        (Fault("after_sync_snapshot", "task1#0", nth=3), Fault("before_connect", "task0#0", attempt=1)),
    ],
    ids=["peer-killed-while-connecting", "killed-after-connecting", "killed-while-the-restart-connects"],
)
def test_a_worker_killed_while_the_workers_connect_fails_only_the_attempt(tmp_path, capfd, faults):
    result = run_with(tmp_path, *faults, restarts=3)
    assert len(result.restarts) == len(faults)
    assert all("signal 9" in r["error"] for r in result.restarts), result.restarts
    log = capfd.readouterr().err
    assert "[abs] job 'crash': worker" in log and "job 'crash': job 'crash'" not in log
    assert "restore='latest'" not in log  # the job restores itself: no advice to do it by hand


class _DiesBeforeItConnects(abs.LocalExecutor):
    """Worker 1 of the first ``times`` attempts is a process killed (SIGKILL) before it could
    connect to the driver; the other workers are real."""

    def __init__(self, times: int) -> None:
        super().__init__()
        self.times = times

    def launch(self, index, boot):
        if index == 1 and self.times > 0:
            self.times -= 1
            return killed_process()
        return super().launch(index, boot)


def test_a_worker_lost_before_it_connects_leaves_no_thread_and_no_traceback(tmp_path, monkeypatch):
    """The driver accepted the workers' connections in a thread; when the start-up failed
    first (a worker died before it connected), that thread stayed blocked in accept() on the
    closed listener for the process's life, or died with "OSError: listener is closed" printed
    on stderr when a worker connected as the listener closed (seen with kill -9 of a worker
    while a restart started). The job restarts and is exact; nothing of the failed starts
    is left."""
    raised: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    before = set(threading.enumerate())
    out = str(tmp_path / "out")
    result = abs.run(flow(out), parallelism=3, executor=_DiesBeforeItConnects(times=3),
                     checkpoint=abs.CheckpointConfig(interval=0.25, retained=2), storage=str(tmp_path / "snap"),
                     restart=abs.RestartStrategy(max_restarts=3, delay=0.1))
    assert result.status == "FINISHED" and len(result.restarts) == 3
    assert all("worker 1" in r["error"] and "signal 9" in r["error"] for r in result.restarts), result.restarts
    assert_exactly_once(out)
    assert not raised, raised
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()]
    assert not left, left


class FaultsInAttempts:
    """A ``faults`` schedule for the ``faulty://`` file system that is in force only in some
    attempts of a job, in its driver or in its workers (and their writer processes).

    The driver opens its storage root once per attempt, in this (the test's) process: each
    iteration here is one open. A worker gets a copy of this object taken when its attempt
    began, so its count of opens names its attempt."""

    def __init__(self, faults, attempts, where):
        self.faults, self.attempts, self.where = list(faults), frozenset(attempts), where
        self.driver_pid, self.opens = os.getpid(), 0

    def __iter__(self):
        in_driver = os.getpid() == self.driver_pid
        self.opens += in_driver
        active = self.opens - 1 in self.attempts and self.where == ("driver" if in_driver else "workers")
        return iter(self.faults if active else ())


UNREACHABLE = [StorageFault(op="read", times=None), StorageFault(op="write", times=None)]


@pytest.mark.parametrize(
    "where, first_fault, match",
    [
        # the restart finds the root unreachable: opening it (reading _job.json) fails
        ("driver", Fault("after_sync_snapshot", "task1#0", nth=3), "StorageUnavailableError"),
        # the workers of the restart cannot read their state files while restoring
        ("workers", Fault("after_sync_snapshot", "task1#0", nth=3), "failed while restoring its state: StorageUnavailableError"),
        # ... or read them torn (a short read): the restore refuses the corrupt data
        ("workers-torn", Fault("after_sync_snapshot", "task1#0", nth=3), "failed while restoring its state: CorruptFileError"),
    ],
)
def test_a_storage_outage_during_the_restart_is_retried_until_it_clears(tmp_path, where, first_fault, match):
    schedule = {"driver": UNREACHABLE,
                "workers": [StorageFault(op="read", times=None, path_glob="*/state/*")],
                "workers-torn": [StorageFault(op="read", times=None, action="tear_silent", path_glob="*/state/*")]}
    faults = FaultsInAttempts(schedule[where], attempts={1}, where=where.split("-")[0])
    root = tmp_path / "snap"
    result = run_with(tmp_path, first_fault, restarts=3, storage=f"faulty://{root}",
                      storage_options={"target_protocol": "file", "faults": faults})
    assert [r["attempt"] for r in result.restarts] == [1, 2]
    assert match in result.restarts[1]["error"], result.restarts
    assert result.restarts[1]["error"].count(match.split()[-1]) == 1  # the cause once, in one line
    assert result.restored_from is not None  # the attempt after the outage restored a checkpoint


def test_a_full_disk_when_the_job_fingerprint_is_written_is_retried(tmp_path):
    faults = FaultsInAttempts([StorageFault(op="write", times=None, path_glob="*_job*")], attempts={0}, where="driver")
    result = run_with(tmp_path, restarts=1, storage=f"faulty://{tmp_path / 'snap'}",
                      storage_options={"target_protocol": "file", "faults": faults})
    assert len(result.restarts) == 1 and "_job.json" in result.restarts[0]["error"], result.restarts
    assert result.restored_from is None  # nothing to restore yet: the retry starts from scratch


def test_a_storage_failure_at_every_attempt_says_the_job_gave_up_and_carries_its_restarts(tmp_path):
    """The root cannot take ``_job.json`` at any attempt (a disk that stays full): the storage
    error is raised as itself, says that the restarts were used up, and carries the result."""
    faults = FaultsInAttempts([StorageFault(op="write", times=None, path_glob="*_job*")], attempts={0, 1},
                              where="driver")
    with pytest.raises(StorageUnavailableError) as err:
        run_with(tmp_path, restarts=1, storage=f"faulty://{tmp_path / 'snap'}",
                 storage_options={"target_protocol": "file", "faults": faults})
    assert "_job.json" in str(err.value) and "gave up after 1 restart" in str(err.value), str(err.value)
    assert "restore='latest'" in str(err.value)
    assert len(err.value.result.restarts) == 1 and err.value.result.status == "FAILED"


def test_a_restore_failure_in_a_worker_names_the_worker_and_its_cause_when_the_job_gives_up(tmp_path):
    faults = FaultsInAttempts([StorageFault(op="read", times=None, path_glob="*/state/*")], attempts={1, 2},
                              where="workers")
    with pytest.raises(abs.StartupError) as err:
        run_with(tmp_path, Fault("after_sync_snapshot", "task1#0", nth=3), restarts=1,
                 storage=f"faulty://{tmp_path / 'snap'}", storage_options={"target_protocol": "file", "faults": faults})
    first = str(err.value).splitlines()[0]
    assert "failed while restoring its state: StorageUnavailableError" in first and "injected fail" in first
    assert "gave up after 1 restart" in str(err.value) and "restore='latest'" in str(err.value)
    assert not err.value.permanent and len(err.value.result.restarts) == 1


class BadOptionSource(abs.GeneratorSource):
    """Its readers refuse their configuration: the same in every attempt."""

    def create_reader(self, splits, subtask, parallelism):
        raise abs.ConfigError("BadOptionSource: option 'speed' must be positive, got -1; pass speed=1")


def test_a_permanent_error_while_starting_fails_at_once_and_uses_no_restart(tmp_path, capfd):
    f = abs.Dataflow("crash")
    f.source("src", BadOptionSource(1_000, num_keys=10)).sink("out", abs.CollectSink())
    with pytest.raises(abs.StartupError, match=r"worker \d failed while creating its tasks: ConfigError: "
                       r"BadOptionSource: option 'speed'") as err:
        abs.run(f, parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.25), storage=str(tmp_path / "snap"),
                restart=abs.RestartStrategy(max_restarts=3, delay=0.1))
    assert err.value.permanent and err.value.result.restarts == []
    assert "restart 1 of" not in capfd.readouterr().err


def test_a_storage_root_of_another_job_fails_at_once_and_uses_no_restart(tmp_path, capfd):
    SnapshotStore.open(str(tmp_path / "snap")).init_job({"job_name": "another", "max_parallelism": 128})
    with pytest.raises(JobMismatchError, match="belongs to job 'another'"):
        abs.run(flow(str(tmp_path / "out")), parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.25),
                storage=str(tmp_path / "snap"), restart=abs.RestartStrategy(max_restarts=3, delay=0.1))
    assert "restart 1 of" not in capfd.readouterr().err


def test_a_final_checkpoint_that_cannot_complete_fails_the_job_over(tmp_path):
    """Every state write of the first attempt's workers fails: no checkpoint completes, the
    final one neither; the job fails over (it does not wait for good) and the next attempt,
    whose storage works, finishes with exact output."""
    faults = FaultsInAttempts([StorageFault(op="write", times=None, path_glob="*/state/*")], attempts={0},
                              where="workers")
    result = run_with(tmp_path, restarts=1, storage=f"faulty://{tmp_path / 'snap'}", paced=False,
                      storage_options={"target_protocol": "file", "faults": faults})
    assert len(result.restarts) == 1 and "final checkpoint failed 5 times" in result.restarts[0]["error"]
    assert any("upload failed" in why for _cid, why in result.failed_checkpoints)
