"""Unaligned checkpoints under backpressure (issue target 7a).

A keyed running count whose output goes through a stage that sleeps per record (an emulated
slow sink, half the source's rate): every queue between the stages stays full. Checkpoints
every 0.5 s in three modes, alternating within every round (the machine is shared): aligned,
unaligned, and aligned with ``alignment_timeout`` (switching to unaligned after it). Printed
per mode over the checkpoints taken while the source still ran (the first one and those of
the job's end left out): checkpoint duration (trigger to commit), the longest alignment of a
task, and the channel state stored (records a barrier overtook), as median [min - max] over
the rounds of each round's median; then the ratio of the unaligned to the aligned duration
(target: <= 1/5). Every run's output is checked exact.

    .venv/bin/python scripts/bench_unaligned.py [--rounds N] [--records N] [--rate R] [--timeout S]
"""
from __future__ import annotations

import argparse
import collections
import shutil
import statistics
import tempfile
import time

import pyarrow as pa

import abs
from storage import SnapshotStore

TARGET = 1 / 5
KEYS = 100


def count(ctx, r):
    n = (ctx.state.n.value() or 0) + 1
    ctx.state.n.update(n)
    ctx.emit({"key": ctx.key, "n": n})


def build(records: int, rate: float, parallelism: int) -> abs.Dataflow:
    per_row = 2 * parallelism / rate  # the slow stage takes rate / 2 rows per second over its subtasks

    def slow(b: pa.RecordBatch) -> pa.RecordBatch:
        time.sleep(per_row * b.num_rows)
        return b

    flow = abs.Dataflow("bench-unaligned")
    src = abs.GeneratorSource(records, num_keys=KEYS, num_splits=4, batch_size=64, rate=rate / 4)
    flow.source("src", src).key_by("key").process("count", count, state=[abs.ValueState("n", pa.int64())]) \
        .rebalance().map_batches(slow, uid="slow-sink").sink("out", abs.CollectSink())
    return flow


def exact(table: pa.Table, records: int) -> bool:
    per_key = collections.defaultdict(list)
    for k, n in zip(table.column("key").to_pylist(), table.column("n").to_pylist()):
        per_key[k].append(n)
    return len(per_key) == KEYS and all(sorted(v) == list(range(1, records // KEYS + 1)) for v in per_key.values())


def one_run(mode: str, args, root: str) -> dict:
    shutil.rmtree(root, ignore_errors=True)
    config = {"aligned": {}, "unaligned": {"mode": "unaligned"}, "timeout": {"alignment_timeout": args.timeout}}[mode]
    result = abs.run(build(args.records, args.rate, args.parallelism), parallelism=args.parallelism, storage=root,
                     checkpoint=abs.CheckpointConfig(interval=0.5, retained=10_000, **config))
    if not exact(result.collected("out"), args.records):
        raise SystemExit(f"{mode}: the output is not exact")
    processing_end = result.timings["startup_s"] + result.timings["processing_s"]
    steady = [c for c in result.completed_checkpoints[1:] if c.trigger_time + c.duration < processing_end]
    store = SnapshotStore.open(root)
    channel = [store.read_manifest(c.checkpoint_id).stats.get("channel_bytes", 0) for c in steady]
    return {"n": len(steady),
            "duration": statistics.median(c.duration for c in steady) if steady else float("nan"),
            "alignment": statistics.median(c.alignment_time for c in steady) if steady else float("nan"),
            "channel": statistics.median(channel) if channel else 0}


def span(values: list[float], scale: float, unit: str) -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):.0f} {unit} [{min(v):.0f} - {max(v):.0f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--records", type=int, default=24_000)
    ap.add_argument("--rate", type=float, default=4000, help="source records per second (the sink takes half)")
    ap.add_argument("--timeout", type=float, default=0.05, help="alignment_timeout of the timeout mode (s)")
    ap.add_argument("--parallelism", type=int, default=2)
    args = ap.parse_args()
    modes = ["aligned", "unaligned", "timeout"]
    runs: dict = {m: [] for m in modes}
    tmp = tempfile.mkdtemp(prefix="bench-unaligned-")
    try:
        for r in range(args.rounds):
            for mode in modes[r % 3:] + modes[:r % 3]:
                res = one_run(mode, args, f"{tmp}/{mode}")
                runs[mode].append(res)
                print(f"round {r + 1} {mode:9s}: {res['n']} checkpoints under backpressure, duration "
                      f"{res['duration'] * 1e3:.0f} ms, alignment {res['alignment'] * 1e3:.0f} ms, channel state "
                      f"{res['channel'] / 1e3:.0f} KB", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\np={args.parallelism}, source {args.rate:.0f} rec/s, sink {args.rate / 2:.0f} rec/s, {args.rounds} rounds "
          "(median [min - max] of each run's median over its checkpoints under backpressure)")
    for mode in modes:
        rs = runs[mode]
        print(f"{mode:9s}: duration {span([x['duration'] for x in rs], 1e3, 'ms')}, alignment "
              f"{span([x['alignment'] for x in rs], 1e3, 'ms')}, channel state {span([x['channel'] for x in rs], 1e-3, 'KB')}")
    aligned = statistics.median(x["duration"] for x in runs["aligned"])
    for mode in ("unaligned", "timeout"):
        ratio = statistics.median(x["duration"] for x in runs[mode]) / aligned
        print(f"{mode} / aligned duration: {ratio:.2f} (target <= {TARGET:.2f}: {'met' if ratio <= TARGET else 'NOT met'})")


if __name__ == "__main__":
    main()
