"""Restore and rescale benchmark (ratios measured in one run; the machine is shared and noisy).

1. A job puts 1,000,000 keys with ~100-byte values (about 100 MB in memory) into keyed
   state at parallelism 4 and ends with a complete checkpoint on local disk.
2. The same job is restored from it at parallelism 4, 2 (rescale 4 -> 2) and back to 4
   from a checkpoint taken at 2 (rescale 2 -> 4). For each: time from `abs.run` until every
   worker has restored its state and the sources start (time to first record), restore
   throughput per worker in MB/s next to plain pyarrow reading the same files, and bytes
   read per worker against its share (target: at most 1.1 x the share).

``--state sums`` puts the reference workload's state instead: string keys ``"k<i>"`` with an
int64 running sum each (the issue's target: the first record <= 0.6 s after restoring 5 M
keys, and restore >= 0.5 x pyarrow's read speed).

    .venv/bin/python scripts/bench_recovery.py [--keys N] [--state payload|sums]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

import abs
from storage import SnapshotStore


RATIO_TARGET = 0.5  # restore speed against plain pyarrow reading the same files and ranges


class Payloads:
    """Record i: key = i, payload = a ~100-byte string derived from i (replayable)."""

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        payload = [f'{{"id": {i}, "name": "user-{i % 9973}", "score": {i * 7919 % 100000}, "tags": ["a", "b"]}}' for i in idx.tolist()]
        return pa.RecordBatch.from_arrays([pa.array(idx), pa.array(payload)], names=["key", "payload"])


class Sums:
    """Record i: key = "k<i>", value = i % 100 (the reference workload's events)."""

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays([pa.array([f"k{i}" for i in idx.tolist()]), pa.array(idx % 100)],
                                          names=["key", "value"])


def keep_latest(ctx, row):
    ctx.state.last.update(row["payload"])


def running_sum(ctx, row):
    total = ctx.state.total
    total.update((total.value() or 0) + row["value"])


def build(keys: int, count: int | None = None, state: str = "payload") -> abs.Dataflow:
    flow = abs.Dataflow("bench-restore")
    src = abs.GeneratorSource(keys if count is None else count, num_keys=keys, num_splits=8, batch_size=8192,
                              make_batch=Payloads() if state == "payload" else Sums())
    if state == "payload":
        flow.source("events", src).key_by("key").process("latest", keep_latest, state=[abs.ValueState("last", pa.string())])
    else:
        flow.source("events", src).key_by("key").process("sum", running_sum, state=[abs.ValueState("total", pa.int64())])
    return flow


def pyarrow_read_speed(root: str) -> tuple[float, int, int]:
    """MB/s of plain pyarrow reading every state file and range of the latest checkpoint (one
    process), the bytes a full restore reads (each file, or each key group's range of a packed
    file, once) and the bytes of the distinct files on disk.

    A range of a packed file is a complete IPC stream (one key group's, or in format 6 a
    shared range of several key groups' rows): it is read on its own, once, as a restore reads
    it; the whole packed file is not one stream (reading it as one would stop after its first
    range)."""
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.latest_checkpoint())
    by_path: dict[str, list] = {}
    for ref in {ref.range_id: ref for ref in manifest.files().values()}.values():  # a shared range once
        by_path.setdefault(ref.path, []).append(ref)
    total = sum(ref.read_size for refs in by_path.values() for ref in refs)
    on_disk = sum(os.path.getsize(os.path.join(root, path)) for path in by_path)
    rows = 0
    t0 = time.perf_counter()
    for path, refs in by_path.items():
        with pa.memory_map(os.path.join(root, path)) as f:
            data = f.read_buffer()
            for ref in refs:
                part = data if ref.offset is None else data.slice(ref.offset, ref.read_size)
                if part.size >= 6 and part[:6].to_pybytes() == b"ARROW1":  # format 1: IPC file
                    rows += pa.ipc.open_file(part).read_all().num_rows
                else:  # format 2 and later: IPC stream
                    rows += pa.ipc.open_stream(part).read_all().num_rows
    seconds = time.perf_counter() - t0
    expected = sum(ref.rows if ref.range_rows is None else ref.range_rows for refs in by_path.values() for ref in refs)
    if rows != expected:
        raise RuntimeError(f"pyarrow read {rows} rows, the manifest lists {expected}; the benchmark reads the files wrongly")
    return total / seconds / 1e6, total, on_disk


def restore(flow: abs.Dataflow, root: str, parallelism: int) -> abs.JobResult:
    return abs.run(flow, parallelism=parallelism, restore="latest", storage=root, checkpoint=abs.CheckpointConfig())


def report(label: str, result: abs.JobResult, total_bytes: int, raw_mbs: float) -> None:
    P = result.parallelism
    share = total_bytes / P
    per = result.bytes_restored_per_worker
    secs = result.restore_seconds_per_worker
    rates = [b / s / 1e6 for b, s in zip(per, secs) if s > 0]
    worst = max(per) / share
    ratio = np.mean(rates) / raw_mbs
    together = sum(per) / max(secs) / 1e6 if secs and max(secs) > 0 else float("nan")
    print(f"  {label:<16} time to first record {result.timings['startup_s']:5.2f} s; "
          f"restore per worker {np.mean(rates):6.1f} MB/s (pyarrow raw read {raw_mbs:6.1f} MB/s, ratio {ratio:4.2f}, "
          f"target >= {RATIO_TARGET}: {'met' if ratio >= RATIO_TARGET else 'NOT met'}; all {P} workers together "
          f"{together:6.1f} MB/s, on {os.cpu_count()} CPUs); "
          f"bytes read per worker / share: max {worst:4.2f}, mean {np.mean(per) / share:4.2f} "
          f"(target <= 1.1: {'met' if worst <= 1.1 else 'NOT met'})", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--state", choices=["payload", "sums"], default="payload",
                    help="~100-byte string values under int keys, or int64 sums under string keys")
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="abs-bench-restore-")
    try:
        flow = build(args.keys, state=args.state)
        t0 = time.perf_counter()
        first = abs.run(flow, parallelism=4, storage=root, checkpoint=abs.CheckpointConfig(retained=10))
        raw_mbs, total, on_disk = pyarrow_read_speed(root)
        print(f"state: {args.keys:,} keys written at parallelism 4 in {time.perf_counter() - t0:.1f} s; "
              f"checkpoint {first.last_checkpoint}: {total / 1e6:.1f} MB to restore ({on_disk / 1e6:.1f} MB of files "
              f"on disk, older checkpoints' ranges included)")
        cold = abs.run(build(args.keys, count=0, state=args.state), parallelism=4)
        print(f"  baseline: start-up without restore {cold.timings['startup_s']:.2f} s")
        report("restore 4 -> 4", restore(flow, root, 4), total, raw_mbs)
        r2 = restore(flow, root, 2)
        report("rescale 4 -> 2", r2, total, raw_mbs)
        raw_mbs, total, _ = pyarrow_read_speed(root)  # the checkpoint written at parallelism 2
        report("rescale 2 -> 4", restore(flow, root, 4), total, raw_mbs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
