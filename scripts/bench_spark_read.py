#!/usr/bin/env python
"""Spark read benchmark: ``spark.read.format("abs-snapshot")`` against Spark reading Parquet.

    .venv/bin/python scripts/bench_spark_read.py [--keys 1000000] [--key-groups 128]
        [--delta-percent 0] [--repeat 3] [--per-partition 1,16] [--master local[2]] [--root DIR]

1. writes a checkpoint of N int64 keys with ~100-byte string values in K key groups with
   :class:`SnapshotStore` (optionally a second checkpoint changing ``--delta-percent`` % of
   the keys, so the executors resolve base + delta chains);
2. writes the same resolved rows (key_group, key, value) as Parquet with pyarrow, one file
   per key group;
3. times, on one local Spark session, ``count()`` and a full scan
   (``agg(sum(length(value)))``) of both, best of ``--repeat`` runs after one warm-up, and
   the abs-snapshot read for several ``keyGroupsPerPartition`` values.

Prints rows/s side by side and the ratio. Parquet's ``count()`` answers from file footers
without reading values, so the full scan is the comparable figure. No assertions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from abs.keygroups import key_groups  # noqa: E402
from storage import Manifest, SnapshotStore  # noqa: E402

OP, STATE, JOB = "bench", "value", "bench-spark-read"


def values_for(keys: np.ndarray, version: int) -> pa.Array:
    cities = ("Berlin", "Lisbon", "Osaka", "Denver", "Nairobi", "Quito", "Perth", "Oslo")
    text = [f'{{"user":{k:08d},"count":{(k * 7 + version) % 10_000:05d},"city":"{cities[k % 8]:<8}",'
            f'"tier":"gold","v":{version},"ok":true,"pad":"x"}}'
            for k in keys.tolist()]
    return pa.array(text, pa.string())


def write_snapshot(root: str, n: int, k: int, delta_percent: float) -> tuple[int, pa.Table, float]:
    """Returns (checkpoint id to read, the resolved rows, seconds spent writing)."""
    started = time.perf_counter()
    store = SnapshotStore.open(root, fsync=False)
    store.init_job({"job_name": JOB, "max_parallelism": k})
    keys = np.arange(n, dtype=np.int64)
    kgs = key_groups(keys, k)
    values = values_for(keys, 1)
    order = np.argsort(kgs, kind="stable")
    bounds = np.searchsorted(kgs[order], np.arange(k + 1))
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    chains: dict[int, list] = {}
    for kg in range(k):
        idx = order[bounds[kg]:bounds[kg + 1]]
        table = pa.table({"key": pa.array(keys[idx]), "value": values.take(pa.array(idx))}).replace_schema_metadata(meta)
        chains[kg] = store.write_key_group(1, OP, STATE, kg, [], table)
    store.commit(Manifest(checkpoint_id=1, job_name=JOB, max_parallelism=k, keyed={OP: {STATE: dict(chains)}}))
    cid = 1
    if delta_percent > 0:
        rng = np.random.default_rng(7)
        changed = np.sort(rng.choice(n, size=max(1, int(n * delta_percent / 100)), replace=False)).astype(np.int64)
        new_values = values_for(changed, 2)
        ckg = key_groups(changed, k)
        for kg in np.unique(ckg).tolist():
            sel = np.nonzero(ckg == kg)[0]
            table = pa.table({"key": pa.array(changed[sel]), "value": new_values.take(pa.array(sel)),
                              "op": pa.array(np.zeros(len(sel), np.int8))}).replace_schema_metadata(meta)
            chains[kg] = store.write_key_group(2, OP, STATE, kg, chains[kg], table)
        store.commit(Manifest(checkpoint_id=2, job_name=JOB, max_parallelism=k, keyed={OP: {STATE: dict(chains)}}))
        cid = 2
    elapsed = time.perf_counter() - started
    manifest = store.read_manifest(cid)
    resolved = [store.read_key_group(manifest, OP, STATE, kg).select(["key", "value"]) for kg in range(k)]
    tables = [pa.table({"key_group": pa.array(np.full(t.num_rows, kg, np.int32)), "key": t["key"], "value": t["value"]})
              for kg, t in enumerate(resolved)]
    return cid, pa.concat_tables(tables), elapsed


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    fn()  # warm-up: Python workers, JIT, page cache
    times, result = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    return min(times), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--key-groups", type=int, default=128)
    ap.add_argument("--delta-percent", type=float, default=0.0,
                    help="also write a second checkpoint changing this %% of the keys (default 0: one base per key group)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--per-partition", default="1,16", help="keyGroupsPerPartition values to time (comma-separated)")
    ap.add_argument("--master", default="local[2]")
    ap.add_argument("--root", help="work directory (default: a temporary one, removed afterwards)")
    args = ap.parse_args()

    work = args.root or tempfile.mkdtemp(prefix="bench-spark-read-")
    root, parquet_dir = os.path.join(work, "snapshot"), os.path.join(work, "parquet")
    for path in (root, parquet_dir):
        shutil.rmtree(path, ignore_errors=True)
    try:
        cid, rows, write_s = write_snapshot(root, args.keys, args.key_groups, args.delta_percent)
        os.makedirs(parquet_dir)
        kg_col = rows.column("key_group").to_numpy()
        for kg in range(args.key_groups):
            pq.write_table(rows.filter(pa.array(kg_col == kg)), os.path.join(parquet_dir, f"kg-{kg:04d}.parquet"))
        snap_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
        pq_bytes = sum(os.path.getsize(os.path.join(parquet_dir, f)) for f in os.listdir(parquet_dir))
        expected_len = int(np.sum(np.asarray(pa.compute.utf8_length(rows.column("value")))))
        print(f"rows {rows.num_rows:,} in {args.key_groups} key groups, checkpoint {cid}"
              f"{f' (base + {args.delta_percent}% delta)' if cid > 1 else ' (bases only)'}; "
              f"snapshot {snap_bytes / 2**20:.1f} MiB written in {write_s:.2f} s, parquet {pq_bytes / 2**20:.1f} MiB")

        os.environ["PYSPARK_PYTHON"] = sys.executable
        os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
        from pyspark.sql import SparkSession
        from pyspark.sql import functions as F

        import storage.spark

        started = time.perf_counter()
        spark = (SparkSession.builder.master(args.master).appName("bench-spark-read")
                 .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
                 .config("spark.sql.shuffle.partitions", "2").getOrCreate())
        spark.sparkContext.setLogLevel("ERROR")
        storage.spark.register(spark)
        print(f"spark {spark.version} session on {args.master}: {time.perf_counter() - started:.1f} s")

        def snap(per: int | None = None) -> Any:
            r = spark.read.format("abs-snapshot").option("operator", OP).option("state", STATE).option("checkpoint", cid)
            if per is not None:
                r = r.option("keyGroupsPerPartition", per)
            return r.load(root)

        def scan(df: Any) -> int:
            return df.agg(F.sum(F.length("value"))).collect()[0][0]

        n = rows.num_rows
        results: list[tuple[str, str, float, float, int]] = []
        pq_count_s, pq_count = best_of(lambda: spark.read.parquet(parquet_dir).count(), args.repeat)
        pq_scan_s, pq_len = best_of(lambda: scan(spark.read.parquet(parquet_dir)), args.repeat)
        assert pq_count == n and pq_len == expected_len, (pq_count, pq_len)
        pq_parts = spark.read.parquet(parquet_dir).rdd.getNumPartitions()
        variants = [None] + [int(v) for v in args.per_partition.split(",") if v.strip()]
        for per in variants:
            label = "auto" if per is None else str(per)
            parts = snap(per).rdd.getNumPartitions()
            count_s, count = best_of(lambda: snap(per).count(), args.repeat)
            scan_s, total = best_of(lambda: scan(snap(per)), args.repeat)
            assert count == n and total == expected_len, (count, total)
            results.append((label, str(parts), count_s, scan_s, count))

        print()
        print(f"{'reader':<42}{'partitions':>11}{'count() s':>11}{'rows/s':>14}{'scan s':>9}{'rows/s':>14}"
              f"{'scan time / parquet':>21}")
        print(f"{'parquet (pyarrow-written)':<42}{pq_parts:>11}{pq_count_s:>11.3f}{n / pq_count_s:>14,.0f}"
              f"{pq_scan_s:>9.3f}{n / pq_scan_s:>14,.0f}{'1.00':>21}")
        for label, parts, count_s, scan_s, _ in results:
            print(f"{'abs-snapshot keyGroupsPerPartition=' + label:<42}{parts:>11}{count_s:>11.3f}{n / count_s:>14,.0f}"
                  f"{scan_s:>9.3f}{n / scan_s:>14,.0f}{scan_s / pq_scan_s:>21.2f}")
        print("\n(times: best of", args.repeat, "after one warm-up; each includes planning: for abs-snapshot the "
              "manifest and a sample file are read in a Python worker at load())")
        spark.stop()
    finally:
        if not args.root:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
