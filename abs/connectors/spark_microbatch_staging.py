"""Staging a micro-batch from Spark's own tasks (``SparkMicroBatchSource(stage_on="executors")``):
a Python data source writer registered per attempt writes each task's partition as Parquet
parts into the batch's directory of the log, and its commit lists the parts of the tasks Spark
kept; the driver's ``foreachBatch`` only reads that list. Also the Parquet parts of a table
staged by the driver, and the facts about Spark's checkpoint the source needs."""
from __future__ import annotations

import io
import json
import logging
import os
import socket
import uuid
from typing import Any, Callable, Iterator, Mapping

import pyarrow as pa

from .batchlog import SparkSourceError, _Log


log = logging.getLogger(__name__)


def _stage_data_source(log: _Log, name: str, part_rows: int) -> Any:
    """A PySpark Python data source (registered as ``name``) whose Arrow writer stages a
    micro-batch from the executors: each task writes its partition as Parquet parts into
    the batch's directory of ``log`` and returns their entries; the commit (run by Spark once
    every task succeeded, with the messages of the tasks it kept) writes the list as
    ``<directory>/_parts-<token>.json`` for the driver. The options (``directory``,
    ``token``, ``per_partition``) are plain strings; the log (with its storage options)
    travels inside the pickled writer, not in the query plan."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Parts(WriterCommitMessage):
        def __init__(self, parts: list) -> None:
            self.parts = parts

    class Writer(DataSourceArrowWriter):
        def __init__(self, options: Any) -> None:
            self.directory = str(options["directory"])
            self.token = str(options["token"])
            self.per_partition = int(options["per_partition"])

        def write(self, iterator: Iterator[pa.RecordBatch]) -> Any:
            from pyspark import TaskContext

            chunks = [b for b in iterator if b.num_rows]
            if not chunks:
                return Parts([])
            table = pa.Table.from_batches(chunks)
            ctx = TaskContext.get()
            pid, attempt = (ctx.partitionId(), ctx.attemptNumber()) if ctx is not None else (0, 0)
            rows = table.num_rows
            count = min(rows, max(self.per_partition, -(-rows // part_rows)))
            token = self.token
            parts = _write_parts(log, self.directory, table, count,
                                 lambda k: f"part-{pid:05d}-{k:04d}-{token}-{attempt}.parquet")
            return Parts([dict(p, partition=pid, seq=k) for k, p in enumerate(parts)])

        def commit(self, messages: list) -> None:
            parts = sorted((p for m in messages if m is not None for p in m.parts),
                           key=lambda p: (p["partition"], p["seq"]))
            log.put(log.path(self.directory, f"_parts-{self.token}.json"), json.dumps(parts).encode())

        def abort(self, messages: list) -> None:
            return None  # the parts written stay unlisted; Spark replays the batch

    class StageSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return name

        def writer(self, schema: Any, overwrite: bool) -> Any:
            return Writer(self.options)

    return StageSource


def _write_parts(log: Any, directory: str, table: pa.Table, count: int, name: Callable[[int], str]) -> list[dict]:
    """``table`` as ``count`` Parquet parts of about equal rows in ``directory`` of the log
    (part ``k`` named ``name(k)``): their entries (file, rows, bytes, the writing process).
    Run by the driver (``stage_on="driver"``) or in a micro-batch's Spark tasks."""
    import pyarrow.parquet as pq

    rows = table.num_rows
    parts = []
    for k in range(count):
        lo, hi = rows * k // count, rows * (k + 1) // count
        buf = io.BytesIO()
        pq.write_table(table.slice(lo, hi - lo), buf)
        file = name(k)
        log.put(log.path(directory, file), buf.getvalue())
        parts.append({"file": file, "rows": hi - lo, "bytes": buf.tell(), "writer": f"{socket.gethostname()}:{os.getpid()}"})
    return parts


def _stage_on_executors(session: Any, df: Any, source_name: str, log: _Log, directory: str,
                        num_splits: int) -> list[dict]:
    """Write micro-batch ``df`` as Parquet parts into ``directory`` from the executors (one
    Spark job); the parts' entries for the manifest, in partition order."""
    try:
        partitions = int(df._jdf.rdd().getNumPartitions())
    except Exception:  # noqa: BLE001 - not a JVM-backed DataFrame
        partitions = num_splits
    token = uuid.uuid4().hex
    (df.write.format(source_name).mode("append").option("directory", directory).option("token", token)
     .option("per_partition", str(max(1, -(-num_splits // max(1, partitions))))).save())
    parts = log.read_json(log.path(directory, f"_parts-{token}.json"))
    if parts is None:
        raise SparkSourceError(f"the executors staged {directory} of {log.url} but wrote no list of its parts")
    return [{k: p[k] for k in ("file", "rows", "bytes", "writer")} for p in parts]


def _lanes_after(manifest: Mapping[str, Any], num_splits: int) -> list[int]:
    """Rows staged per lane up to and including the manifest's batch."""
    rows = list(manifest["lanes_before"])
    for k, part in enumerate(manifest["parts"]):
        rows[(int(manifest["batch"]) + k) % num_splits] += int(part["rows"])
    return rows


def _spark_checkpoint_has_progress(location: str) -> bool:
    try:
        from fsspec.core import url_to_fs

        url = location.replace("s3a://", "s3://", 1)
        fs, path = url_to_fs(url)
        return bool(fs.ls(path.rstrip("/") + "/commits", detail=False))
    except Exception:  # noqa: BLE001 - missing or unreadable: treat as empty
        return False
