"""The Spark launcher: the same job on a real local Spark master (one barrier stage of P
tasks) gives the local launcher's results; a worker killed with SIGKILL inside a Spark task
fails the stage, and the driver restores and resubmits with exact output."""
from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.faults import Fault
from abs.connectors.file_sink import FileSink, read_output
from pacing import PacedSource
from processes import abs_workers, parent_of, wait_while_running
from storage import SnapshotStore

pytestmark = [pytest.mark.integration, pytest.mark.spark]

TOTAL, KEYS = 30_000, 250


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def counting_flow(sink: abs.Sink, per_checkpoint: int | None = None) -> abs.Dataflow:
    """The counting job; ``per_checkpoint``: each source reader emits at most that many records
    per completed checkpoint, so that checkpoints (and faults after them) fall mid-input
    however loaded the machine."""
    flow = abs.Dataflow("spark-counts")
    src: abs.Source = abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=6, batch_size=250)
    if per_checkpoint is not None:
        src = PacedSource(src, per_checkpoint)
    flow.source("src", src).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", sink)
    return flow


def per_key_counts(table: pa.Table) -> dict:
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    return {k: sorted(v) for k, v in per_key.items()}


EXPECTED = {k: list(range(1, n + 1)) for k, n in collections.Counter((np.arange(TOTAL) % KEYS).tolist()).items()}


def final_state(root: str) -> dict:
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.latest_checkpoint())
    values: dict = {}
    for kg in manifest.keyed["count"]["n"]:
        t = store.read_key_group(manifest, "count", "n", kg)
        values.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    return values


def test_same_job_same_results_on_the_local_and_the_spark_launcher(spark, tmp_path):
    checkpoint = abs.CheckpointConfig(interval=0.2, retained=3)
    local = abs.run(counting_flow(abs.CollectSink(), per_checkpoint=4_000), parallelism=3, checkpoint=checkpoint,
                    storage=str(tmp_path / "local"))
    on_spark = abs.run(counting_flow(abs.CollectSink(), per_checkpoint=4_000), executor=abs.SparkExecutor(spark, num_workers=3),
                       checkpoint=checkpoint, storage=str(tmp_path / "spark"))
    assert on_spark.status == local.status == "FINISHED"
    assert on_spark.parallelism == 3
    assert len(on_spark.completed_checkpoints) >= 2, "checkpoints are taken while the stage runs"
    assert per_key_counts(on_spark.collected("out")) == per_key_counts(local.collected("out")) == EXPECTED
    assert on_spark.records_in == local.records_in
    assert final_state(str(tmp_path / "spark")) == final_state(str(tmp_path / "local"))
    # restoring a Spark run's checkpoint with the local launcher (and back) is the same format
    assert SnapshotStore.open(str(tmp_path / "spark")).verify().ok


def test_worker_killed_inside_a_spark_task_recovers_with_exact_output(spark, tmp_path):
    out = str(tmp_path / "out")
    result = abs.run(
        counting_flow(FileSink(out, format="parquet"), per_checkpoint=3_000),  # 5 checkpoints or more
        executor=abs.SparkExecutor(spark, num_workers=2),
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=2),
        storage=str(tmp_path / "snap"),
        restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
        # a real SIGKILL of worker 1 (the child process of Spark task 1) right after the 2nd
        # checkpoint's manifest is committed, before the workers hear of it
        runtime=abs.RuntimeOptions(faults=[Fault("after_commit", "task1#1", nth=2)]),
    )
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1, result.restarts
    assert result.restarts[0]["restored_from"] == 2, "the second stage restored the latest checkpoint"
    assert per_key_counts(read_output(out, "parquet")) == EXPECTED
    assert SnapshotStore.open(str(tmp_path / "snap")).verify().ok


def test_collect_sink_is_exactly_once_across_a_restart_on_spark(spark, tmp_path):
    result = abs.run(
        counting_flow(abs.CollectSink(), per_checkpoint=3_000),
        executor=abs.SparkExecutor(spark, num_workers=2),
        checkpoint=abs.CheckpointConfig(interval=0.2),
        storage=str(tmp_path / "snap"),
        restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
        runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#0", nth=10_000)]),
    )
    assert len(result.restarts) == 1
    assert per_key_counts(result.collected("out")) == EXPECTED


def test_too_few_slots_fail_at_once_naming_the_numbers(spark):
    slots = spark.sparkContext.defaultParallelism
    with pytest.raises(abs.ConfigError, match=rf"needs {slots + 1} task slots.*has {slots} slot") as err:
        abs.run(counting_flow(abs.CollectSink()), executor=abs.SparkExecutor(spark, num_workers=slots + 1))
    # refused by the up-front check, before a launch: launching waits for busy slots first
    # (and Spark itself waits for minutes), the same message only after that wait
    assert not [entry for entry in err.traceback if entry.name == "launch_all"], "refused at launch, after waiting"


def test_bad_spark_configurations_are_refused(spark):
    with pytest.raises(abs.ConfigError, match="needs an active SparkSession"):
        abs.SparkExecutor(None, num_workers=2)
    with pytest.raises(abs.ConfigError, match="needs a pyspark.sql.SparkSession"):
        abs.SparkExecutor(object(), num_workers=2)
    with pytest.raises(abs.ConfigError, match="num_workers must be a positive integer"):
        abs.SparkExecutor(spark, num_workers=0)
    with pytest.raises(abs.ConfigError, match=r"num_workers=2\) but parallelism=3"):
        abs.run(counting_flow(abs.CollectSink()), parallelism=3, executor=abs.SparkExecutor(spark, num_workers=2))
    with pytest.raises(abs.ConfigError, match="process-local memory"):
        abs.run(counting_flow(abs.CollectSink()), executor=abs.SparkExecutor(spark, num_workers=2),
                storage="memory://abs-spark-test", checkpoint=abs.CheckpointConfig(interval=1.0))



def test_a_killed_spark_python_worker_names_the_worker_of_its_task_and_sparks_reason(spark, monkeypatch, tmp_path):
    """SIGKILL of the Spark Python worker that runs a task (its abs worker dies with it) fails
    the barrier stage with Spark's reason and no abs worker exit status. The driver took that
    for a failure of every worker and named worker 0, whichever task it was, as having 'exited
    with code 1'; it names the worker of the failed task and Spark's reason (or, when the
    dropped connection is seen first, that worker's lost connection), and the restart is exact."""
    from abs.runtime.spark import _SparkWorker, _stage_failure

    def kill_own_python_worker_in_partition_1(rows):  # nested: pickled by value (tests/ is not on Spark's path)
        import os as os_
        import signal as signal_

        from pyspark import BarrierTaskContext

        if BarrierTaskContext.get().partitionId() == 1:
            os_.kill(os_.getpid(), signal_.SIGKILL)
        yield from rows

    # the stage's error as Spark words it when a task's Python worker is killed
    with pytest.raises(Exception) as info:
        spark.sparkContext.parallelize(range(4), 2).barrier().mapPartitions(kill_own_python_worker_in_partition_1).collect()
    index, code, reason = _stage_failure(str(info.value), [5, 7])
    assert (index, code) == (7, None) and reason.startswith("Python worker exited unexpectedly"), str(info.value)

    pids: dict[int, int] = {}
    bind = _SparkWorker.bind_pid
    monkeypatch.setattr(_SparkWorker, "bind_pid", lambda self, pid: (pids.__setitem__(self.index, pid), bind(self, pid)))
    job = abs.submit(
        counting_flow(abs.CollectSink(), per_checkpoint=2_000),
        executor=abs.SparkExecutor(spark, num_workers=2),
        checkpoint=abs.CheckpointConfig(interval=0.2),
        storage=str(tmp_path / "snap"),
        restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
    )
    wait_while_running("two workers and a complete checkpoint",
                       lambda: len(pids) == 2 and job.metrics()["completed_checkpoints"] >= 1, job)
    victim = pids[1]  # (a restart binds the pids of its own workers)
    os.kill(parent_of(victim), signal.SIGKILL)  # the Spark Python worker running its task
    result = job.wait()
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1, result.restarts
    error = result.restarts[0]["error"]
    assert error == "lost the connection to worker 1" or (
        f"worker 1 (pid {victim}) ended with its Spark task, which failed: Python worker exited unexpectedly"
        in error), error
    assert per_key_counts(result.collected("out")) == EXPECTED


KILL_THE_JVM = '''
import os, signal, sys, time
import pyarrow as pa
from pyspark.sql import SparkSession
import abs
from processes import processes
from test_spark_executor import count_fn

os.environ["PYSPARK_PYTHON"] = sys.executable
spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate())
flow = abs.Dataflow("jvm-lost")
flow.source("src", abs.GeneratorSource(None, num_keys=50, num_splits=2, batch_size=100, rate=2000)).key_by(
    "key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
job = abs.submit(flow, executor=abs.SparkExecutor(spark, num_workers=2), checkpoint=abs.CheckpointConfig(interval=0.2),
                 storage=sys.argv[1], restart=abs.RestartStrategy(max_restarts=3, delay=0.1))
while job.metrics()["completed_checkpoints"] < 1:
    assert job.metrics()["status"] in ("CREATED", "RUNNING"), job.metrics()["status"]
    time.sleep(0.05)
for pid, (parent, cmdline) in processes().items():  # the JVM this process started (pyspark's gateway)
    if parent == os.getpid() and b"java" in cmdline.split(b"\\0")[0]:
        os.kill(pid, signal.SIGKILL)
try:
    job.wait()
except Exception as e:
    print("ERROR", type(e).__name__, e)
    print("RESTARTS", len(job.metrics()["restarts"]))
os._exit(0)
'''


def test_a_killed_spark_jvm_fails_the_job_at_once_saying_so(tmp_path):
    """SIGKILL of the Spark driver JVM behind the session (local mode: the executor too) while a
    job runs on it: every restart failed at once on the dead Py4J gateway, and the job ended
    with "job 'x' failed: [Errno 111] Connection refused". It fails at its first restart, naming
    the lost JVM and what to do, and uses up no further restart. (Its own Python process:
    the test session's Spark is not to be killed.)"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run([sys.executable, "-c", KILL_THE_JVM, str(tmp_path / "snap")], capture_output=True,
                          text=True, env=env, timeout=300, cwd=os.path.dirname(__file__))
    assert "ERROR ConfigError SparkExecutor: the Spark driver JVM of this SparkSession is gone" in proc.stdout, \
        proc.stdout + proc.stderr[-3000:]
    assert "restore='latest'" in proc.stdout
    assert "RESTARTS 1" in proc.stdout, proc.stdout
