"""The Spark launcher against the local launcher (ratios measured in one run; the machine is
shared and noisy).

The reference workload (keyed running sum, (key, value) events over 100,000 keys, ABS every
1 s, final per-key sums checked exactly) at parallelism 2, on the local launcher and on a
local Spark master (one barrier stage of 2 tasks), for the per-record ``process`` path and
the vectorized ``aggregate``. Runs alternate (local, Spark, local, Spark, ...) so that both
see the same machine; the best of ``--repeat`` runs is compared. Target: Spark within 10 % of
local.

Also: time from ``abs.run`` to the first record (the earliest moment any worker's source
emitted its first batch, stamped by the worker itself), local vs Spark, with a warm Spark
session (its start-up, a one-off cost of the application, is reported separately).

    .venv/bin/python scripts/bench_spark.py [--events N] [--repeat R]

On a standalone cluster (``scripts/cluster up --dir D``): ``--cluster D`` runs the Spark
executor on its master (the driver on the ``driver_host`` it printed) and keeps every
snapshot on its S3 server, for the local executor too; then it also measures

- the restore time per worker from S3: the job run again with ``restore='latest'`` (its
  input is exhausted, so the attempt is the restore), per worker, local and Spark;
- the ``abs-snapshot`` data source against Spark reading Parquet of the same state: the
  final checkpoint's state scanned in full (``count`` and ``sum(value)``) from S3 and from a
  local copy, and the same rows written as Parquet (one file per key group) on local disk
  (Spark here has no S3 connector for Parquet), rows/s, best of ``--repeat``.

    scripts/cluster up --hosts 3 --dir /tmp/c && \
      .venv/bin/python scripts/bench_spark.py --cluster /tmp/c --events 500000
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any

import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import abs  # noqa: E402
from bench_overhead import KeyValueBatches, expected_sums, running_sum  # noqa: E402
from storage import SnapshotStore  # noqa: E402


class StampFirst:
    """map_batches pass-through that records the wall time of the first batch it sees."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.done = False

    def __call__(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        if not self.done:
            self.done = True
            with open(os.path.join(self.directory, f"{os.getpid()}-{time.time_ns()}"), "w") as f:
                f.write(repr(time.time()))
        return batch


def build(events: int, keys: int, path: str, stamps: str) -> abs.Dataflow:
    flow = abs.Dataflow(f"bench-spark-{path}")
    src = abs.GeneratorSource(events, num_keys=keys, num_splits=8, batch_size=8192, make_batch=KeyValueBatches(keys))
    keyed = flow.source("events", src).map_batches(StampFirst(stamps)).key_by("key")
    if path == "process":
        keyed.process("sum", running_sum, state=[abs.ValueState("total", pa.int64())])
    else:
        keyed.aggregate("sum", {"total": ("value", "sum")}, emit="none")
    return flow


def final_sums(root: str, options: dict | None = None) -> dict:
    store = SnapshotStore.open(root, options)
    manifest = store.read_manifest(store.latest_checkpoint())
    out: dict = {}
    for kg in manifest.keyed["sum"]["total"]:
        t = store.read_key_group(manifest, "sum", "total", kg)
        out.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
    return out


class Storage:
    """Where the runs keep their snapshots: temporary local directories, or prefixes on the
    cluster's S3 server."""

    def __init__(self, s3_endpoint: str | None) -> None:
        self.options = None
        if s3_endpoint is not None:
            import fsspec

            self.options = {"key": "bench", "secret": "bench", "endpoint_url": s3_endpoint}
            self.fs = fsspec.filesystem("s3", skip_instance_cache=True, **self.options)
            if not self.fs.exists("abs-bench"):
                self.fs.mkdir("abs-bench")

    def new(self) -> str:
        if self.options is None:
            return tempfile.mkdtemp(prefix="abs-bench-spark-")
        return f"s3://abs-bench/{uuid.uuid4().hex}"

    def remove(self, root: str) -> None:
        if self.options is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            self.fs.rm(root, recursive=True)


def run_once(events: int, keys: int, path: str, executor: object, expected: dict, storage: Storage,
             keep: bool = False) -> dict:
    root = storage.new()
    stamps = tempfile.mkdtemp(prefix="abs-stamps-")
    try:
        t_call = time.time()
        result = abs.run(build(events, keys, path, stamps), parallelism=2, executor=executor,
                         checkpoint=abs.CheckpointConfig(interval=1.0, retained=2), storage=root,
                         storage_options=storage.options)
        first = min(float(open(os.path.join(stamps, f)).read()) for f in os.listdir(stamps))
        return {
            "throughput": events / result.timings["processing_s"],
            "first_record_s": first - t_call,
            "checkpoints": len(result.completed_checkpoints),
            "exact": final_sums(root, storage.options) == expected,
            "root": root if keep else None,
        }
    finally:
        if not keep:
            storage.remove(root)
        shutil.rmtree(stamps, ignore_errors=True)


def restore_once(events: int, keys: int, path: str, executor: object, root: str, storage: Storage) -> dict:
    """The job of ``root`` again with restore='latest': its input is exhausted, so the attempt
    is the restore of the final checkpoint; per worker: seconds and bytes read."""
    stamps = tempfile.mkdtemp(prefix="abs-stamps-")
    try:
        result = abs.run(build(events, keys, path, stamps), parallelism=2, executor=executor,
                         checkpoint=abs.CheckpointConfig(interval=1.0, retained=2), storage=root,
                         storage_options=storage.options, restore="latest")
        return {"seconds": list(result.restore_seconds_per_worker), "bytes": list(result.bytes_restored_per_worker)}
    finally:
        shutil.rmtree(stamps, ignore_errors=True)


def best_of(repeat: int, fn: Any) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_compare(spark: Any, root: str, storage: Storage, repeat: int) -> None:
    """Full scans of the final state: the abs-snapshot data source (S3 and a local copy)
    against Spark reading the same rows as Parquet on local disk."""
    import json

    import pyarrow.parquet as pq
    import storage.spark as sspark
    from pyspark.sql import functions as F

    sspark.register(spark)
    local = tempfile.mkdtemp(prefix="abs-bench-read-")
    try:
        copy = os.path.join(local, "snapshot")
        storage.fs.get(root.rstrip("/") + "/", copy, recursive=True)
        store = SnapshotStore.open(copy)
        manifest = store.read_manifest(store.latest_checkpoint())
        parquet = os.path.join(local, "parquet")
        os.makedirs(parquet)
        rows = 0
        for kg in manifest.keyed["sum"]["total"]:
            t = store.read_key_group(manifest, "sum", "total", kg)
            rows += t.num_rows
            pq.write_table(t.select(["key", "value"]).append_column("key_group", pa.array([kg] * t.num_rows, pa.int32())),
                           os.path.join(parquet, f"kg-{kg:05d}.parquet"))

        def scan(df: Any) -> None:
            df.agg(F.count("*"), F.sum("value")).collect()

        def snapshot(path: str, options: dict | None) -> Any:
            reader = spark.read.format("abs-snapshot").option("operator", "sum").option("state", "total")
            if options:
                reader = reader.option("storageOptions", json.dumps(options))
            return reader.load(path)

        cases = [("abs-snapshot, S3", lambda: scan(snapshot(root, storage.options))),
                 ("abs-snapshot, local copy", lambda: scan(snapshot(copy, None))),
                 ("Parquet, local", lambda: scan(spark.read.parquet(parquet)))]
        for _label, fn in cases:
            fn()  # warm-up
        print(f"state scan ({rows:,} keys of the final checkpoint), best of {repeat}:")
        for label, fn in cases:
            seconds = best_of(repeat, fn)
            print(f"  {label:<26} {rows / seconds:>12,.0f} rows/s  ({seconds:.2f} s)", flush=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)


def cluster_session(directory: str) -> tuple[Any, dict]:
    import json

    from pyspark.sql import SparkSession

    with open(os.path.join(directory, "cluster.json")) as f:
        state = json.load(f)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [repo, os.path.join(repo, "scripts")]
    spark = (SparkSession.builder.master(state["master_url"]).appName("abs-bench-spark")
             .config("spark.driver.host", state["driver_host"]).config("spark.driver.bindAddress", state["driver_host"])
             .config("spark.driver.memory", "1g").config("spark.executor.memory", "768m")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(paths)).getOrCreate())
    return spark, state


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cluster", metavar="DIR",
                    help="the directory of a cluster started by scripts/cluster up --dir DIR: Spark on its master, "
                         "snapshots on its S3 server; also restore times and the data source's scan rate")
    args = ap.parse_args()

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if args.cluster is None:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    t0 = time.monotonic()
    if args.cluster is not None:
        spark, state = cluster_session(args.cluster)
        where, storage = state["master_url"], Storage(state["s3_endpoint"])
    else:
        spark = (SparkSession.builder.master("local[2]").appName("abs-bench-spark")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
        where, storage = "local[2]", Storage(None)
    spark.sparkContext.setLogLevel("ERROR")
    spark.sparkContext.parallelize([1, 2], 2).count()  # the first Python job starts both Python workers
    print(f"Spark session {where} up in {time.monotonic() - t0:.1f} s (one-off, not counted below); snapshots "
          f"{'on the cluster S3 server' if storage.options else 'on local disk'}")
    expected = expected_sums(args.events, args.keys)
    print(f"reference workload: {args.events:,} events over {args.keys:,} keys, parallelism 2, ABS every 1 s, "
          f"best of {args.repeat}")
    ok = True
    kept: dict[str, str] = {}
    for path in ("process", "aggregate"):
        best: dict[str, dict] = {}
        for r in range(args.repeat):
            for label, executor in (("local", "local"), ("spark", abs.SparkExecutor(spark, num_workers=2))):
                keep = args.cluster is not None and path == "process" and r == args.repeat - 1
                stats = run_once(args.events, args.keys, path, executor, expected, storage, keep=keep)
                if stats["root"] is not None:
                    kept[label] = stats["root"]
                ok &= stats["exact"]
                prev = best.get(label)
                if prev is None or stats["throughput"] > prev["throughput"]:
                    best[label] = {**stats, "first_record_s": min(stats["first_record_s"], prev["first_record_s"])
                                   if prev else stats["first_record_s"]}
                elif stats["first_record_s"] < prev["first_record_s"]:
                    prev["first_record_s"] = stats["first_record_s"]
                print(f"  {path:<9} {label:<5} {stats['throughput']:>11,.0f} events/s  first record after "
                      f"{stats['first_record_s']:.2f} s  checkpoints {stats['checkpoints']}  sums exact: {stats['exact']}",
                      flush=True)
        ratio = best["spark"]["throughput"] / best["local"]["throughput"]
        print(f"  => {path}: Spark/local throughput {ratio:.3f} (target >= 0.90: {'met' if ratio >= 0.9 else 'NOT met'}); "
              f"first record: local {best['local']['first_record_s']:.2f} s, Spark {best['spark']['first_record_s']:.2f} s")
    if kept:
        print("restore of the final checkpoint from S3 (the process path's job run again, restore='latest'):")
        for label, executor in (("local", "local"), ("spark", abs.SparkExecutor(spark, num_workers=2))):
            for _ in range(args.repeat):
                got = restore_once(args.events, args.keys, "process", executor, kept[label], storage)
                per = ", ".join(f"{s:.2f} s ({b / 2**20:.1f} MiB)" for s, b in zip(got["seconds"], got["bytes"]))
                print(f"  {label:<5} per worker: {per}", flush=True)
        read_compare(spark, kept["spark"], storage, max(2, args.repeat))
        for root in kept.values():
            storage.remove(root)
    spark.stop()
    if not ok:
        print("ERROR: final per-key sums differ from the input", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
