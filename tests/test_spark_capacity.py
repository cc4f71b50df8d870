"""Running on the slots there are (``RestartStrategy.min_workers``) on a real local Spark
master (``local[4]``): a worker killed while another Spark job waits for slots; the restart
finds fewer than the job's three slots free, goes on with fewer workers from the latest
checkpoint, and once the other job ends the driver rescales the job back to three, live;
the output is exact. Without the option the same restart would wait for all three slots."""
from __future__ import annotations

import os
import signal
import threading
import types
from pathlib import Path

import pytest

import abs
from abs.connectors.file_sink import FileSink, read_output
from pacing import PacedSource
from processes import abs_workers, wait_while_running
from storage import SnapshotStore
from test_spark_executor import EXPECTED, KEYS, TOTAL, count_fn, per_key_counts

import pyarrow as pa

pytestmark = [pytest.mark.integration, pytest.mark.spark, pytest.mark.timeout(300)]


def _hold_slots(spark, tasks: int, flag: Path, started: Path) -> threading.Thread:
    """Another Spark job of ``tasks`` tasks, each holding its slot while ``flag`` exists."""
    def body(i):
        import os as _os
        import time as _time
        open(_os.path.join(str(started), f"task-{i}"), "w").close()
        while _os.path.exists(str(flag)):
            _time.sleep(0.05)

    thread = threading.Thread(target=lambda: spark.sparkContext.parallelize(range(tasks), tasks).foreach(body),
                              daemon=True)
    thread.start()
    return thread


def test_a_restart_without_enough_slots_goes_on_with_fewer_workers_and_rescales_back_when_they_free(spark, tmp_path):
    gate, flag, started = tmp_path / "go-on", tmp_path / "hold", tmp_path / "started"
    flag.write_text("")
    started.mkdir()
    flow = abs.Dataflow("spark-capacity")
    # every split waits at 3,000 of its 5,000 records until the gate opens: the job is
    # certainly running while slots are taken, freed and the job rescales
    src = PacedSource(abs.GeneratorSource(TOTAL, num_keys=KEYS, num_splits=6, batch_size=250), 1_000,
                      hold_per_split=3_000, gate=str(gate))
    flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", FileSink(str(tmp_path / "out"), format="parquet"))
    handle = abs.submit(flow, executor=abs.SparkExecutor(spark, num_workers=3, slot_wait=3.0),
                        checkpoint=abs.CheckpointConfig(interval=0.2, retained=3), storage=str(tmp_path / "snap"),
                        restart=abs.RestartStrategy(max_restarts=2, delay=0.1, min_workers=1))
    try:
        wait_while_running("a first checkpoint", lambda: (handle.metrics()["last_checkpoint"] or 0) >= 1, handle)
        assert handle.metrics()["workers"] == 3
        # the fourth slot is taken by another job; its second task waits for a slot
        holder = _hold_slots(spark, 2, flag, started)
        wait_while_running("the other job's first task", lambda: len(os.listdir(started)) >= 1, handle)
        os.kill(abs_workers()[-1], signal.SIGKILL)  # the stage fails; the waiting task takes a freed slot
        wait_while_running("the restart with fewer workers",
              lambda: len(handle.metrics()["restarts"]) >= 1
              and handle.metrics()["status"] == "RUNNING" and handle.metrics()["workers"] < 3, handle)
        reduced = handle.metrics()["workers"]
        flag.unlink()  # the other job ends: its slots are free again
        holder.join(60)
        wait_while_running("the live rescale back to three workers",
              lambda: any(r.kind == "rescale" and r.status == "COMPLETED" for r in handle.reconfigurations()), handle)
        assert handle.metrics()["workers"] == 3
    finally:
        gate.write_text("")
        if flag.exists():
            flag.unlink()
    result = handle.wait(timeout=240)
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1, result.restarts
    assert result.restarts[0]["workers"] == reduced < 3
    assert result.parallelism == 3
    assert per_key_counts(read_output(str(tmp_path / "out"), "parquet")) == EXPECTED
    assert SnapshotStore.open(str(tmp_path / "snap")).verify().ok


def _lingering_body(marker: str):
    """Barrier tasks: task 0 fails at once; the others outlive the failed stage by ~3 s (they
    ignore the interrupt and SIGTERM), as a worker's task does while its process is reaped."""
    def body(it):
        import os as _os
        import signal as _signal
        import time as _time
        if list(it)[0] == 0:
            while not _os.path.exists(marker):  # both others run: their slots are taken
                _time.sleep(0.05)
            raise RuntimeError("the first task fails")
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
        open(marker, "a").close()
        end = _time.monotonic() + 3.0
        while _time.monotonic() < end:
            try:
                _time.sleep(0.05)
            except BaseException:  # noqa: BLE001 - outlive the kill on purpose
                pass
        return []
    return body


def test_a_restart_counts_the_slots_of_its_own_failed_stage_as_free_once_its_tasks_end(spark, tmp_path):
    """A failed barrier stage ends for the driver before Spark has reaped its other tasks: a
    restart waits for them instead of counting their slots as taken by someone else."""
    from abs.runtime.spark import _active_tasks
    sc = spark.sparkContext
    run = types.SimpleNamespace(group="abs-test-lingering", done=threading.Event())

    def stage():
        sc.setJobGroup(run.group, "lingering tasks", interruptOnCancel=True)
        try:
            sc.parallelize(range(3), 3).barrier().mapPartitions(_lingering_body(str(tmp_path / "m"))).collect()
        except Exception:  # noqa: BLE001 - the failure is the point
            pass
        finally:
            run.done.set()

    threading.Thread(target=stage, daemon=True).start()
    assert run.done.wait(120), "the barrier stage did not fail"
    assert _active_tasks(sc, run.group) == 2  # the two others still hold their slots
    executor = abs.SparkExecutor(spark, num_workers=3, slot_wait=0.2)
    executor._runs.append(run)
    can, slots = executor.available_workers(3)
    assert (can, _active_tasks(sc, run.group)) == (3, 0), slots


def test_min_workers_is_checked():
    with pytest.raises(abs.ConfigError, match="min_workers must be an integer >= 1"):
        abs.RestartStrategy(min_workers=0)
    flow = abs.Dataflow("f")
    flow.source("s", abs.GeneratorSource(10, num_keys=2)).sink("out", abs.CollectSink())
    with pytest.raises(abs.ConfigError, match=r"min_workers=3 is more than the job's parallelism 2"):
        abs.run(flow, parallelism=2, restart=abs.RestartStrategy(max_restarts=1, min_workers=3))
