"""Spark streaming sources (abs.connectors.spark_stream, abs.connectors.spark_microbatch): a PySpark Python data source stream reader
and a Structured Streaming DataFrame run as exactly-once ABS sources, with real worker
processes, real checkpoints, a real ``kill -9`` in the middle and real Spark (local)."""
from __future__ import annotations

import collections
import functools
import json
import os
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pytest

pytest.importorskip("pyspark")

from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition, SimpleDataSourceStreamReader
from pyspark.sql.streaming.datasource import ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import LongType, Row, StringType, StructField, StructType

import abs
from abs.errors import ConfigError
from abs.faults import Fault
from abs.connectors.file_sink import FileSink, read_output
from abs.connectors.spark_microbatch import SparkMicroBatchSource
from abs.connectors.spark_stream import SparkStreamSource
from pacing import PacedSource
from storage import SnapshotStore
from storage.paths import StoragePaths

pytestmark = pytest.mark.integration

TOTAL = 6000  # rows of the test stream
KEYS = 37
PART_ROWS = 50  # rows per InputPartition
BATCH_ROWS = 100  # rows per planned batch (the reader's default ReadMaxRows)


# --------------------------------------------------------------------------- test data source


class RangePartition(InputPartition):
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi


class CountingReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Rows ``i = 0 .. total-1`` as ``(id=i, key=i % KEYS, name="row-i")``; the offset is the
    number of rows; partitions are fixed ranges of PART_ROWS; all rows are available at once,
    or, with the option ``available`` (a file path), as many as that file says (the test
    writes it; none while it is missing; all under availableNow). ``commit(end)`` is
    appended, with the time, to the file ``commit_log``."""

    def __init__(self, options) -> None:
        self.total = int(options.get("total", TOTAL))
        self.available = options.get("available")
        self.delay = float(options.get("read_delay", 0))
        self.commit_log = options.get("commit_log")
        self.batch_rows = int(options.get("batch_rows", BATCH_ROWS))
        self.target = None

    def initialOffset(self):
        return {"rows": 0}

    def getDefaultReadLimit(self):
        return ReadMaxRows(self.batch_rows)

    def prepareForTriggerAvailableNow(self):
        self.target = self.total

    def latestOffset(self, start, limit):
        if self.target is not None or self.available is None:
            available = self.target if self.target is not None else self.total
        else:
            try:
                with open(self.available) as f:
                    available = min(self.total, int(f.read()))
            except FileNotFoundError:
                available = 0
        end = min(available, start["rows"] + limit.max_rows) if isinstance(limit, ReadMaxRows) else available
        return {"rows": max(start["rows"], end)}

    def partitions(self, start, end):
        return [RangePartition(lo, min(lo + PART_ROWS, end["rows"])) for lo in range(start["rows"], end["rows"], PART_ROWS)]

    def read(self, partition):
        if self.delay:
            time.sleep(self.delay)
        for i in range(partition.lo, partition.hi):
            yield (i, i % KEYS, f"row-{i}")

    def commit(self, end):
        if self.commit_log:
            with open(self.commit_log, "a") as f:
                f.write(json.dumps({"t": time.time(), "end": end}) + "\n")


class CountingSource(DataSource):
    @classmethod
    def name(cls):
        return "abs_counting"

    def schema(self):
        return "id long, key long, name string"  # a DDL string: parsed with the Spark session

    def streamReader(self, schema):
        return CountingReader(self.options)


class FlakyReader(CountingReader):
    """Planning fails once (the first time a range from row 500 on is planned)."""

    def partitions(self, start, end):
        flag = self.commit_log + ".failed"
        if start["rows"] >= 500 and not os.path.exists(flag):
            open(flag, "w").close()
            raise ValueError("planner boom")
        return super().partitions(start, end)


class FlakySource(CountingSource):
    def streamReader(self, schema):
        return FlakyReader(self.options)


class SimpleCounting(SimpleDataSourceStreamReader):
    """A simple stream reader (no partitions of its own) yielding pyspark Rows."""

    def initialOffset(self):
        return {"rows": 0}

    def read(self, start):
        return iter([]), {"rows": 500}

    def readBetweenOffsets(self, start, end):
        return (Row(id=i, key=i % KEYS, name=f"row-{i}") for i in range(start["rows"], end["rows"]))


class SimpleSource(DataSource):
    def schema(self):
        return StructType([StructField("id", LongType()), StructField("key", LongType()), StructField("name", StringType())])

    def simpleStreamReader(self, schema):
        return SimpleCounting()


class ArrowReader(DataSourceStreamReader):
    """Yields pyarrow RecordBatches from read() (latestOffset with the old signature)."""

    def initialOffset(self):
        return {"n": 0}

    def latestOffset(self):
        return {"n": 800}

    def partitions(self, start, end):
        return [RangePartition(lo, lo + 100) for lo in range(start["n"], end["n"], 100)]

    def read(self, partition):
        ids = pa.array(range(partition.lo, partition.hi), pa.int64())
        yield pa.RecordBatch.from_arrays([ids, pa.compute.remainder(ids, KEYS), ids.cast(pa.string())],
                                         names=["id", "key", "name"])


class NoStreamSource(DataSource):
    def schema(self):
        return "id long"


# --------------------------------------------------------------------------- helpers


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "id": row["id"], "count": c})


def slow_identity(delay: float, row: dict) -> dict:
    time.sleep(delay)
    return row


def counting_flow(source: abs.Source, sink: abs.Sink, slow: float = 0.0) -> abs.Dataflow:
    f = abs.Dataflow("spark-sources")
    stream = f.source("src", source)
    if slow:
        # chained into the source task: the source reads a staged part over several polls,
        # so checkpoints store offsets in the middle of parts
        stream = stream.map(functools.partial(slow_identity, slow))
    stream.key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", sink)
    return f


def assert_exactly_once(table: pa.Table, total: int) -> None:
    ids = table.column("id").to_pylist()
    assert len(ids) == total, f"{len(ids)} rows, expected {total}"
    assert sorted(ids) == list(range(total)), "rows lost or duplicated"
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter(i % KEYS for i in range(total))
    assert {k: sorted(v) for k, v in per_key.items()} == {k: list(range(1, n + 1)) for k, n in expected.items()}


def read_commits(path) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def lane_bound(offsets: dict) -> int:
    return min(o["batch"] for o in offsets.values())


def log_batch_ids(log_dir) -> list[int]:
    return sorted(int(n[6:18]) for n in os.listdir(log_dir) if n.startswith("batch-"))


def counting(tmp_path, **options) -> SparkStreamSource:
    opts = {"commit_log": str(tmp_path / "commits.jsonl"), **{k: str(v) for k, v in options.items()}}
    return SparkStreamSource(CountingSource, opts, num_splits=4, bounded=True, batch_size=20)


def paced(source: abs.Source) -> PacedSource:
    """``source`` whose readers (two, at P = 2) emit at most 500 of their ~3,000 rows per
    completed checkpoint: checkpoints fall all along the stream however loaded the machine."""
    return PacedSource(source, 500)


# --------------------------------------------------------------------------- SparkStreamSource


def test_stream_source_exactly_once_and_commit_only_what_completed_checkpoints_cover(spark, tmp_path):
    snap, out = str(tmp_path / "snap"), str(tmp_path / "out")
    src = counting(tmp_path, read_delay=0.02)
    result = abs.run(
        counting_flow(paced(src), FileSink(out)), parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=100), storage=snap,
    )
    assert result.status == "FINISHED"
    assert len(result.completed_checkpoints) >= 3
    assert_exactly_once(read_output(out), TOTAL)

    # what each completed checkpoint covers: batch b holds rows [100 b, 100 b + 100)
    store = SnapshotStore.open(snap)
    covered = {}
    for cid in store.list_checkpoints():
        bound = lane_bound(store.read_manifest(cid).source_offsets["src"])
        mtime = os.stat(os.path.join(snap, StoragePaths.manifest(cid))).st_mtime
        covered[cid] = (min(TOTAL, BATCH_ROWS * bound), mtime)
    assert [c.checkpoint_id for c in result.completed_checkpoints] == sorted(covered)
    commits = read_commits(tmp_path / "commits.jsonl")
    ends = [c["end"]["rows"] for c in commits]
    assert len(commits) >= 2 and ends[-1] == TOTAL
    assert ends == sorted(set(ends)), "commit(end) called twice for an end or out of order"
    for c in commits:
        assert any(rows >= c["end"]["rows"] and mtime <= c["t"] for rows, mtime in covered.values()), (
            f"commit({c['end']}) at {c['t']} is not covered by a checkpoint completed before it: {covered}"
        )
    # some checkpoints fell in the middle of the stream: commits were incremental
    assert any(0 < rows < TOTAL for rows, _ in covered.values())

    log_dir = os.path.join(snap, "sources", "src")
    with open(os.path.join(log_dir, "_end.json")) as f:
        assert json.load(f) == {"batches": TOTAL // BATCH_ROWS}
    # the first batches were fully consumed by the first checkpoints: deleted
    first_bound = lane_bound(store.read_manifest(min(covered)).source_offsets["src"])
    assert log_batch_ids(log_dir)[0] >= min(first_bound, TOTAL // BATCH_ROWS - 1)


def test_stream_source_on_the_spark_launcher_survives_a_killed_task_exactly_once(spark, tmp_path):
    """The data source wrapper and the barrier-stage launcher together: workers are Spark
    tasks, one is SIGKILLed after the 2nd checkpoint commits, the next stage restores."""
    out = str(tmp_path / "out")
    result = abs.run(
        counting_flow(paced(counting(tmp_path, read_delay=0.02)), FileSink(out)),
        executor=abs.SparkExecutor(spark, num_workers=2),
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=3), storage=str(tmp_path / "snap"),
        restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
        runtime=abs.RuntimeOptions(faults=[Fault("after_commit", "task1#1", nth=2)]),
    )
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1 and result.restarts[0]["restored_from"] == 2
    assert_exactly_once(read_output(out), TOTAL)


def test_stream_source_kill_9_mid_stream_replays_exactly(spark, tmp_path):
    snap, out = str(tmp_path / "snap"), str(tmp_path / "out")
    src = counting(tmp_path, read_delay=0.03)
    result = abs.run(
        counting_flow(paced(src), FileSink(out)), parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=2), storage=snap,
        restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
        # about 3,000 records reach each keyed subtask: crash 2/3 of the way
        runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#0", nth=2_000)]),
    )
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1 and "signal 9" in result.restarts[0]["error"]
    assert result.restarts[0]["restored_from"] is not None, "the crash should come after a complete checkpoint"
    assert_exactly_once(read_output(out), TOTAL)

    ends = [c["end"]["rows"] for c in read_commits(tmp_path / "commits.jsonl")]
    assert ends and ends[-1] == TOTAL and ends == sorted(set(ends))
    # log retention: only batches the retained checkpoints may need (and the newest) are left
    store = SnapshotStore.open(snap)
    retained = store.list_checkpoints()
    assert len(retained) == 2
    needed = min(lane_bound(store.read_manifest(c).source_offsets["src"]) for c in retained)
    left = log_batch_ids(os.path.join(snap, "sources", "src"))
    assert left and left[0] >= min(needed, TOTAL // BATCH_ROWS - 1)
    assert left[-1] == TOTAL // BATCH_ROWS - 1


def committed_ends(tmp_path) -> list[int]:
    return [c["end"]["rows"] for c in read_commits(tmp_path / "commits.jsonl")]


def wait_for(what: str, done, deadline: float) -> None:
    """Poll ``done()`` until it holds; the deadline only bounds a hang."""
    while not done():
        if time.monotonic() > deadline:
            pytest.fail(f"gave up waiting: {what}")
        time.sleep(0.05)


def test_unbounded_stream_source_keeps_planning_and_cancel_keeps_committed_output_exact(spark, tmp_path):
    snap, out = str(tmp_path / "snap"), str(tmp_path / "out")
    available = tmp_path / "available"
    opts = {"available": str(available), "commit_log": str(tmp_path / "commits.jsonl")}
    src = SparkStreamSource(CountingSource, opts, num_splits=3, trigger_interval=0.05)
    handle = abs.submit(
        counting_flow(src, FileSink(out)), parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=3), storage=snap,
    )
    deadline = time.monotonic() + 240  # only bounds a hang
    # the stream grows in three steps, each once the previous one is committed upstream: the
    # source plans batches as rows arrive (a lane moves past a partition at the poll after
    # its last rows, so a step's last batch may take one more checkpoint to be covered)
    for step in (TOTAL // 3, 2 * TOTAL // 3, TOTAL):
        (tmp_path / "available.tmp").write_text(str(step))
        os.replace(tmp_path / "available.tmp", available)
        wait_for(f"commit({step})", lambda: step in committed_ends(tmp_path), deadline)
    assert handle.status == "RUNNING", "an unbounded stream does not end by itself"
    # later checkpoints add nothing: the stream has no more rows
    seen = handle.metrics()["completed_checkpoints"]
    wait_for("two more checkpoints", lambda: handle.metrics()["completed_checkpoints"] >= seen + 2, deadline)
    result = handle.cancel()
    assert result.status == "CANCELED"
    assert_exactly_once(read_output(out), TOTAL)
    ends = committed_ends(tmp_path)
    assert ends == sorted(set(ends)), "commit(end) called twice for an end or out of order"
    assert {TOTAL // 3, 2 * TOTAL // 3, TOTAL} <= set(ends) and ends[-1] == TOTAL
    assert len(result.completed_checkpoints) >= 3


def test_simple_stream_reader_rows_and_reader_instance_with_arrow_batches(spark, tmp_path):
    simple = SparkStreamSource(SimpleSource, num_splits=2, bounded=True, log=str(tmp_path / "log1"))
    result = abs.run(counting_flow(simple, abs.CollectSink()), parallelism=2)
    assert_exactly_once(result.collected("out"), 500)

    schema = pa.schema([("id", pa.int64()), ("key", pa.int64()), ("name", pa.string())])
    arrow = SparkStreamSource(ArrowReader(), schema=schema, num_splits=3, bounded=True, log=str(tmp_path / "log2"))
    assert arrow.schema == schema
    result = abs.run(counting_flow(arrow, abs.CollectSink()), parallelism=2)
    assert_exactly_once(result.collected("out"), 800)
    assert sorted(result.collected("out").column("id").to_pylist()) == list(range(800))


def test_planner_failure_fails_the_attempt_with_its_message_and_the_restart_recovers(spark, tmp_path, caplog):
    opts = {"total": "1000", "read_delay": "0.01", "commit_log": str(tmp_path / "commits.jsonl")}
    flag = tmp_path / "commits.jsonl.failed"
    # without restarts: the job fails and the error carries the data source's exception
    with pytest.raises(abs.OperatorError, match=r"(?s)operator 'src'.*producer failed.*planner boom"):
        abs.run(counting_flow(SparkStreamSource(FlakySource, opts, num_splits=2, bounded=True), abs.CollectSink()),
                parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.2), storage=str(tmp_path / "snap1"))
    assert flag.exists()
    logged = [r.getMessage() for r in caplog.records if r.name == "abs.connectors.spark_stream" and r.levelname == "ERROR"]
    assert any("the planner failed" in m and "planner boom" in m for m in logged), logged  # on the abs logger
    flag.unlink()
    # with a restart: the next attempt plans again after the last logged batch; exact output
    src = SparkStreamSource(FlakySource, opts, num_splits=2, bounded=True)
    result = abs.run(
        counting_flow(src, abs.CollectSink()), parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2), storage=str(tmp_path / "snap2"),
        restart=abs.RestartStrategy(max_restarts=1, delay=0.1),
    )
    assert len(result.restarts) == 1 and "operator 'src' failed" in result.restarts[0]["error"]
    assert_exactly_once(result.collected("out"), 1000)
    assert not (tmp_path / "snap2" / "sources" / "src" / "_error.json").exists()


def test_log_on_s3_single_put_and_create_if_absent(spark, tmp_path, s3_server, s3_root):
    opts = {"total": "1000", "commit_log": str(tmp_path / "commits.jsonl")}
    src = SparkStreamSource(CountingSource, opts, num_splits=3, bounded=True,
                            log=f"{s3_root}/log", log_options=s3_server.storage_options)
    result = abs.run(counting_flow(src, abs.CollectSink()), parallelism=2)
    assert_exactly_once(result.collected("out"), 1000)
    fs = s3_server.filesystem()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{s3_root}/log"))
    # the batches, the end marker and the lanes' progress (back-pressure), nothing else
    assert names == ["_end.json"] + [f"_read-{lane}.json" for lane in range(3)] + [
        f"batch-{b:012d}.json" for b in range(10)]
    from abs.connectors.batchlog import _Log

    log = _Log(f"{s3_root}/log", s3_server.storage_options)
    assert not log.create(log.path("batch-000000000000.json"), b"{}"), "an existing batch must never be replaced"
    assert json.loads(log.read(log.path("batch-000000000000.json")))["end"] == {"rows": 100}


# --------------------------------------------------------------------------- SparkMicroBatchSource


def write_json_files(directory, files: int, rows: int) -> int:
    os.makedirs(directory)
    for f in range(files):
        with open(os.path.join(directory, f"part-{f:03d}.json"), "w") as fh:
            for i in range(f * rows, (f + 1) * rows):
                fh.write(json.dumps({"id": i, "key": i % KEYS, "name": f"row-{i}"}) + "\n")
    return files * rows


def test_micro_batch_source_file_stream_kill_9_mid_stream_exact_and_staging_cleaned(spark, tmp_path):
    files = 4
    total = write_json_files(tmp_path / "in", files=files, rows=300)
    df = (spark.readStream.schema("id long, key long, name string")
          .option("maxFilesPerTrigger", 1).json(str(tmp_path / "in")))
    src = SparkMicroBatchSource(df, num_splits=4, trigger={"availableNow": True}, batch_size=25)
    snap, out = str(tmp_path / "snap"), str(tmp_path / "out")
    result = abs.run(
        # slow enough that reading, not Spark's staging, is the bottleneck: checkpoints then
        # store offsets in the middle of staged parts, and the restore must skip rows; paced
        # (at most 100 of a reader's ~600 rows per completed checkpoint), so that checkpoints
        # complete before the crash half-way on any machine
        counting_flow(PacedSource(src, 100), FileSink(out), slow=0.008), parallelism=2,
        checkpoint=abs.CheckpointConfig(interval=0.2, retained=2), storage=snap,
        restart=abs.RestartStrategy(max_restarts=2, delay=0.1),
        # about 600 of the 1,200 records reach each keyed subtask: crash half-way
        runtime=abs.RuntimeOptions(faults=[Fault("records", "task1#1", nth=300)]),
    )
    assert result.status == "FINISHED"
    assert len(result.restarts) == 1 and "signal 9" in result.restarts[0]["error"]
    assert result.restarts[0]["restored_from"] is not None, "the crash should come after a complete checkpoint"
    assert_exactly_once(read_output(out), total)

    staging = os.path.join(snap, "sources", "src")
    with open(os.path.join(staging, "_end.json")) as f:
        assert json.load(f) == {"batches": files}  # one micro-batch per file
    store = SnapshotStore.open(snap)
    needed = min(lane_bound(store.read_manifest(c).source_offsets["src"]) for c in store.list_checkpoints())
    left = sorted(int(n[6:]) for n in os.listdir(staging) if n.startswith("batch-"))
    # exactly the batches the retained checkpoints may still replay are left
    assert left == list(range(needed, files)), f"staged batches left: {left}; retained checkpoints need >= {needed}"
    assert not spark.streams.active, "the query must be stopped when the job ends"
    # the parts were written by the query's tasks (Spark's Python workers), not by the driver
    assert src._drv_writers and f"{socket.gethostname()}:{os.getpid()}" not in src._drv_writers


# --------------------------------------------------------------------------- bad input


def test_bad_input_gives_clear_errors(spark, tmp_path, memory_root):
    with pytest.raises(ConfigError, match="not streaming"):
        SparkMicroBatchSource(spark.range(3))
    with pytest.raises(ConfigError, match="streaming pyspark DataFrame"):
        SparkMicroBatchSource([1, 2, 3])
    stream = spark.readStream.format("rate").load()
    with pytest.raises(ConfigError, match="continuous"):
        SparkMicroBatchSource(stream, trigger={"continuous": "1 second"})
    with pytest.raises(ConfigError, match="at most one of"):
        SparkMicroBatchSource(stream, trigger={"every": 3})
    with pytest.raises(ConfigError, match="memory file system"):
        SparkMicroBatchSource(stream, staging=f"{memory_root}/staging")
    with pytest.raises(ConfigError, match="neither streamReader"):
        SparkStreamSource(NoStreamSource)
    with pytest.raises(ConfigError, match="DataSource"):
        SparkStreamSource(42)
    with pytest.raises(ConfigError, match="needs schema="):
        SparkStreamSource(ArrowReader())
    with pytest.raises(ConfigError, match="memory file system.*log="):
        SparkStreamSource(CountingSource, log=f"{memory_root}/log")
    # the default log below a memory:// storage root is refused when the job starts
    with pytest.raises(ConfigError, match="memory file system"):
        abs.run(counting_flow(SparkStreamSource(CountingSource, bounded=True), abs.CollectSink()),
                parallelism=1, checkpoint=abs.CheckpointConfig(interval=1.0), storage=memory_root)
    # no storage and no log=: nowhere to put the log
    with pytest.raises(ConfigError, match="storage=.*log="):
        abs.run(counting_flow(SparkStreamSource(CountingSource, bounded=True), abs.CollectSink()), parallelism=1)


def test_micro_batch_source_on_the_spark_launcher_needs_a_slot_for_its_query(spark, tmp_path):
    """A SparkMicroBatchSource's streaming query runs its tasks in the job's own Spark
    application: a barrier stage of workers on every slot left it none, and the job ran for
    ever without reading a row (checkpoints of nothing, no error). Refused at once, naming the
    source and the numbers."""
    write_json_files(tmp_path / "in", files=1, rows=10)
    df = spark.readStream.schema("id long, key long, name string").json(str(tmp_path / "in"))
    slots = spark.sparkContext.defaultParallelism  # local[4]
    with pytest.raises(ConfigError, match=rf"{slots} workers take all {slots} task slot.*source 'src' "
                                          r"\(SparkMicroBatchSource\).*use at most " + str(slots - 1)):
        job = abs.submit(counting_flow(SparkMicroBatchSource(df, trigger={"availableNow": True}), abs.CollectSink()),
                         executor=abs.SparkExecutor(spark, num_workers=slots),
                         checkpoint=abs.CheckpointConfig(interval=0.2), storage=str(tmp_path / "snap"))
        job.cancel()  # reached only without the check: the job would never end by itself
    assert not spark.streams.active, "refused before the query started"

def test_ddl_schema_without_a_spark_session_is_a_clear_error(tmp_path):
    code = (
        "from pyspark.sql.datasource import DataSource\n"
        "from abs.connectors.spark_stream import SparkStreamSource\n"
        "from abs.errors import ConfigError\n"
        "class D(DataSource):\n"
        "    def schema(self): return 'id long'\n"
        "    def streamReader(self, schema): raise AssertionError\n"
        "try:\n"
        "    SparkStreamSource(D)\n"
        "except ConfigError as e:\n"
        "    print('ERR', e)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "ERR" in proc.stdout, proc.stderr
    assert "active SparkSession" in proc.stdout and "StructType" in proc.stdout


def test_retention_uses_every_stored_checkpoint_and_keeps_what_savepoints_need():
    from abs.connectors.sources import SourceContext
    from abs.connectors.batchlog_backlog import _Retention

    lanes = ["0", "1"]

    def offs(b0, b1):  # lane i at batch b: a unit of batch b belongs to lane (b + j) % 2
        return {"0": {"batch": b0, "partition": b0 % 2, "row": 0}, "1": {"batch": b1, "partition": (b1 + 1) % 2, "row": 0}}

    def ctx(stored, pinned=()):
        return SourceContext(uid="src", job_name="j", parallelism=2, storage_url="/x", storage_options=None,
                             restored_offsets=stored[-1] if stored else None, attempt=1, retained=2,
                             stored_offsets=tuple(stored), pinned_offsets=tuple(pinned))

    # a new driver restoring: both retained checkpoints are known, so deletion starts at once
    r = _Retention()
    r.opened(ctx([offs(3, 4), offs(6, 5)]), 5, fresh=False, lanes=lanes)
    assert r.completed(8) == 5  # min over the last 2: {5, 8}
    # a savepoint in the root (bound 2) keeps its batches whatever completes later
    r = _Retention()
    r.opened(ctx([offs(6, 5), offs(7, 7)], pinned=[offs(2, 3)]), 7, fresh=False, lanes=lanes)
    assert r.completed(9) == 2
    # without the stored offsets (no storage): the old, conservative rule
    r = _Retention()
    r.opened(dataclasses_replace(ctx([offs(6, 5)]), stored_offsets=None, retained=3), 5, fresh=False, lanes=lanes)
    assert r.completed(8) is None and r.completed(9) == 5  # waits until 3 checkpoints are known
    # the same with the stored offsets: known at once
    r = _Retention()
    r.opened(dataclasses_replace(ctx([offs(4, 4), offs(6, 5)]), retained=3), 5, fresh=False, lanes=lanes)
    assert r.completed(8) == 4


def dataclasses_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


# --------------------------------------------------------------------------- back-pressure


def driver_context(**changes):
    from abs.connectors.sources import SourceContext

    base = dict(uid="src", job_name="j", parallelism=1, storage_url=None, storage_options=None,
                restored_offsets=None, attempt=0, retained=1)
    return SourceContext(**{**base, **changes})


def read_until(reader, batch: int, deadline: float) -> list:
    """Poll ``reader`` until every lane has read past batch ``batch - 1``; the rows read."""
    rows = []
    while min(o["batch"] for o in reader.offsets().values()) < batch:
        got = reader.poll()
        if got is None:
            time.sleep(reader.wait_hint())
        elif got is not abs.connectors.sources.END:
            rows.extend(got.column("id").to_pylist())
        if time.monotonic() > deadline:
            pytest.fail(f"the reader did not reach batch {batch}: {reader.offsets()}")
    reader._report(idle=True)  # what the task's next polls do within 0.2 s
    return rows


def held_back(backlog, deadline: float) -> None:
    """Wait until the producer was found held back twice more (it looked at the lanes'
    progress again and still had no room)."""
    start = backlog.waits
    while backlog.waits < start + 2:
        if time.monotonic() > deadline:
            pytest.fail("the producer was not held back")
        backlog.throttled.wait(1.0)


def test_the_planner_stops_at_the_bound_while_the_readers_lag_and_goes_on_as_they_read(spark, tmp_path):
    log_dir = tmp_path / "log"
    src = SparkStreamSource(CountingSource, {"total": 1_000_000}, num_splits=2, log=str(log_dir),
                            trigger_interval=0.0, max_pending_batches=3)
    src.driver_open(driver_context())
    deadline = time.monotonic() + 120
    try:
        reader = src.create_reader({s: src.initial_offset(s) for s in src.splits()}, 0, 1)
        rows: list = []
        for read_from in range(0, 8, 2):
            held_back(src._drv_backlog, deadline)
            # the reader is at batch read_from: exactly the bound's worth is planned, no more
            assert log_batch_ids(log_dir) == list(range(read_from + 3)), (read_from, log_batch_ids(log_dir))
            rows += read_until(reader, read_from + 2, deadline)
        # every row of the first 8 batches once (a lane may have gone on into the next batch)
        assert len(rows) == len(set(rows)) and set(range(8 * BATCH_ROWS)) <= set(rows)
    finally:
        src.driver_close()


def test_micro_batch_staging_holds_the_query_back_at_the_bound(spark, tmp_path):
    total = write_json_files(tmp_path / "in", files=6, rows=40)
    df = (spark.readStream.schema("id long, key long, name string")
          .option("maxFilesPerTrigger", 1).json(str(tmp_path / "in")))
    staging = tmp_path / "staging"
    # staged by the driver (toArrow) here; by the executors in the other tests
    src = SparkMicroBatchSource(df, staging=str(staging), num_splits=2, trigger={"availableNow": True},
                                max_pending_batches=2, stage_on="driver")
    src.driver_open(driver_context())
    deadline = time.monotonic() + 180

    def staged() -> list[int]:
        return sorted(int(n[6:]) for n in os.listdir(staging)
                      if n.startswith("batch-") and os.path.exists(staging / n / "_manifest.json"))

    try:
        reader = src.create_reader({s: src.initial_offset(s) for s in src.splits()}, 0, 1)
        rows: list = []
        for read_from in range(0, 4, 2):
            held_back(src._drv_backlog, deadline)
            # (read batches stay until a completed checkpoint covers them: none here)
            assert staged() == list(range(read_from + 2)), staged()
            rows += read_until(reader, read_from + 2, deadline)
        while (got := reader.poll()) is not abs.connectors.sources.END:
            if got is None:
                time.sleep(reader.wait_hint())
            else:
                rows.extend(got.column("id").to_pylist())
            assert max(staged(), default=0) < min(o["batch"] for o in reader.offsets().values()) + 2
            if time.monotonic() > deadline:
                pytest.fail("the stream did not end")
        assert sorted(rows) == list(range(total))
        assert json.loads((staging / "_end.json").read_text()) == {"batches": 6}
        assert src._drv_writers == {f"{socket.gethostname()}:{os.getpid()}"}
    finally:
        src.driver_close()


# --------------------------------------------------------------------------- savepoints elsewhere


def consumed_rows(offsets: dict, num_splits: int) -> set:
    """Rows of CountingReader read before ``offsets`` (batch b: rows [100 b, 100 b + 100) in
    units of PART_ROWS; unit j of batch b belongs to lane (b + j) % num_splits)."""
    rows = set()
    units = BATCH_ROWS // PART_ROWS
    for lane, o in offsets.items():
        for b in range(o["batch"] + 1):
            for j in range(units):
                if (b + j) % num_splits != int(lane):
                    continue
                lo = BATCH_ROWS * b + PART_ROWS * j
                if b < o["batch"] or j < o["partition"]:
                    rows.update(range(lo, lo + PART_ROWS))
                elif j == o["partition"]:
                    rows.update(range(lo, lo + o["row"]))
    return rows


def test_a_savepoint_in_another_root_restores_exactly_after_the_jobs_log_dropped_its_batches(spark, tmp_path):
    root_a, root_b, root_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    available = tmp_path / "available"
    available.write_text("1500")
    src = SparkStreamSource(CountingSource, {"available": str(available)}, num_splits=3, trigger_interval=0.02)
    handle = abs.submit(counting_flow(src, abs.CollectSink()), parallelism=2,
                        checkpoint=abs.CheckpointConfig(interval=0.1, retained=1), storage=str(root_a))
    deadline = time.monotonic() + 120
    try:
        wait_for("two checkpoints", lambda: (handle.metrics()["last_checkpoint"] or 0) >= 2, deadline)
        savepoint = handle.savepoint(str(root_b))
        sp_offsets = SnapshotStore.open(savepoint).read_manifest(
            SnapshotStore.open(savepoint).list_checkpoints()[-1]).source_offsets["src"]
        bound = lane_bound(sp_offsets)
        # the job goes on; its log drops the batches the savepoint needs as checkpoints complete
        available.write_text("4000")
        log_a = root_a / "sources" / "src"
        wait_for("the job's log dropped the savepoint's batches",
                 lambda: (log_batch_ids(log_a) or [0])[0] > bound, deadline)
    finally:
        handle.cancel()
    copy = root_b / "sources" / "src"
    assert log_batch_ids(copy)[0] <= bound and os.path.exists(copy / "_savepoint.json")
    import shutil

    shutil.rmtree(log_a)  # nothing of the first job's log is left
    # planned with smaller batches now: a planner that started over from the beginning (no
    # log) would log other rows under the batch ids the savepoint's offsets name
    restored = abs.run(
        counting_flow(SparkStreamSource(CountingSource, {"available": str(available), "batch_rows": "70"},
                                        num_splits=3, bounded=True), abs.CollectSink()),
        parallelism=2, checkpoint=abs.CheckpointConfig(interval=0.2), storage=str(root_c), restore=str(root_b),
    )
    assert restored.status == "FINISHED"
    table = restored.collected("out")
    before = consumed_rows(sp_offsets, 3)
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) and set(ids) == set(range(TOTAL)) - before, "rows lost or repeated"
    # the counts go on from the savepoint's state: every key ends at its total, no gaps
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    totals = collections.Counter(i % KEYS for i in range(TOTAL))
    for k, counts in per_key.items():
        assert sorted(counts) == list(range(totals[k] - len(counts) + 1, totals[k] + 1)), k


def test_a_micro_batch_savepoint_in_another_root_carries_the_staged_batches_and_sparks_checkpoint(spark, tmp_path):
    import shutil

    import pyarrow.parquet as pq

    total = write_json_files(tmp_path / "in", files=6, rows=40)

    def source():
        df = (spark.readStream.schema("id long, key long, name string")
              .option("maxFilesPerTrigger", 1).json(str(tmp_path / "in")))
        return SparkMicroBatchSource(df, num_splits=2, trigger={"availableNow": True}, batch_size=10,
                                     max_pending_batches=2)

    root_a, root_b, root_c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    # paced: the readers, and through the bound the query, are still mid-stream at the savepoint
    handle = abs.submit(counting_flow(PacedSource(source(), 20), abs.CollectSink()), parallelism=2,
                        checkpoint=abs.CheckpointConfig(interval=0.1, retained=1), storage=str(root_a))
    deadline = time.monotonic() + 180
    try:
        def some_read() -> bool:
            last = handle.metrics()["last_checkpoint"]
            try:
                offsets = SnapshotStore.open(str(root_a)).read_manifest(last).source_offsets["src"] if last else {}
            except Exception:  # noqa: BLE001 - dropped by retention meanwhile: look again
                return False
            return any(o["batch"] > 0 for o in offsets.values())

        wait_for("a checkpoint past the first batch", some_read, deadline)
        savepoint = handle.savepoint(str(root_b))
    finally:
        handle.cancel()
    store = SnapshotStore.open(savepoint)
    sp_offsets = store.read_manifest(store.list_checkpoints()[-1]).source_offsets["src"]
    copy = root_b / "sources" / "src"
    assert os.path.isdir(copy / "_spark_checkpoint" / "offsets"), "Spark's checkpoint travels with the savepoint"
    # what the savepoint's offsets had read of the copied batches, and what they had not
    read, unread = set(), set()
    for name in sorted(n for n in os.listdir(copy) if n.startswith("batch-")):
        b = int(name[6:])
        parts = json.loads((copy / name / "_manifest.json").read_text())["parts"]
        for j, part in enumerate(parts):
            o = sp_offsets[str((b + j) % 2)]
            ids = pq.read_table(copy / name / part["file"]).column("id").to_pylist()
            done = len(ids) if (b, j) < (o["batch"], o["part"]) else o["row"] if (b, j) == (o["batch"], o["part"]) else 0
            read.update(ids[:done])
            unread.update(ids[done:])
    shutil.rmtree(root_a / "sources")  # the first job's staging and Spark checkpoint are gone
    restored = abs.run(counting_flow(source(), abs.CollectSink()), parallelism=2,
                       checkpoint=abs.CheckpointConfig(interval=0.2), storage=str(root_c), restore=str(root_b))
    assert restored.status == "FINISHED"
    table = restored.collected("out")
    ids = table.column("id").to_pylist()
    assert len(ids) == len(set(ids)) and unread <= set(ids) and not read & set(ids), "rows lost or repeated"
    per_key: dict = collections.defaultdict(list)
    for k, c in zip(table.column("key").to_pylist(), table.column("count").to_pylist()):
        per_key[k].append(c)
    totals = collections.Counter(i % KEYS for i in range(total))
    for k, counts in per_key.items():  # the counts go on from the savepoint's state, up to each key's total
        assert sorted(counts) == list(range(totals[k] - len(counts) + 1, totals[k] + 1)), k
    assert 0 < len(ids) < total, "the savepoint was taken mid-stream"


# --------------------------------------------------------------------------- lag


def test_micro_batch_readers_lag_is_the_staged_rows_they_have_not_emitted_also_after_a_restart(spark, tmp_path):
    total = write_json_files(tmp_path / "in", files=4, rows=40)
    df = (spark.readStream.schema("id long, key long, name string")
          .option("maxFilesPerTrigger", 1).json(str(tmp_path / "in")))
    staging = tmp_path / "staging"
    src = SparkMicroBatchSource(df, staging=str(staging), num_splits=2, trigger={"availableNow": True},
                                batch_size=15, part_rows=10)
    deadline = time.monotonic() + 120
    src.driver_open(driver_context())
    try:
        wait_for("every batch staged", lambda: (staging / "_end.json").exists(), deadline)
        reader = src.create_reader({s: src.initial_offset(s) for s in src.splits()}, 0, 1)
        assert reader.lag() is None, "nothing is known before the first poll"
        read = []
        while len(read) < total // 2:
            got = reader.poll()
            if got is not None:
                read.extend(got.column("id").to_pylist())
            assert reader.lag() == total - len(read)
        offsets = reader.offsets()
    finally:
        src.driver_close()
    # a new attempt restored at these offsets: the counts come back from the staging
    src.driver_open(driver_context(attempt=1, restored_offsets=offsets))
    try:
        reader = src.create_reader(offsets, 0, 1)
        while (got := reader.poll()) is not abs.connectors.sources.END:
            if got is not None:
                read.extend(got.column("id").to_pylist())
            assert reader.lag() == total - len(read)
            if time.monotonic() > deadline:
                pytest.fail("the reader did not end")
        assert sorted(read) == list(range(total)) and reader.lag() == 0
        # one reader per lane: the lags add up to the whole
        lanes = [src.create_reader({s: src.initial_offset(s)}, i, 2) for i, s in enumerate(src.splits())]
        emitted = sum(r.poll().num_rows for r in lanes)
        assert sum(r.lag() for r in lanes) == total - emitted
    finally:
        src.driver_close()

