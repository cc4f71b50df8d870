"""Checkpointing overhead benchmark (ratios measured in one run; the machine is shared and noisy).

1. The ABS paper's experiment on this runtime: the same keyed job with checkpointing off,
   ABS every 1 s, and the synchronous stop-the-world baseline every 1 s, with 1 million
   distinct keys in state. Target: ABS costs at most 5 % of the throughput of "off".
2. The reference workload: 2,000,000 events (key, value) over 100,000 distinct keys, a
   keyed running sum, final per-key sums checked exactly, parallelism 1 and 2, checkpoints
   every 1 s; the per-record `process` path and the vectorized `aggregate`.

Throughput is events / processing time (from the start of the workers to the moment every
source is exhausted; worker start-up and the final checkpoint are reported separately).
Experiment 1 runs at parallelism 1 (one core processes, the other is left to the driver and
the asynchronous part of the snapshots) and 2 (every core processes: the asynchronous part
takes its CPU from processing), each mode ``--rounds`` times, alternating. Its cost figure is
the median over rounds of 1 - ABS/off within a round: runs next to each other in time share
the machine's momentary speed, which on a shared host drifts by 30 % between minutes; the
best-vs-best ratio is printed too. It also prints the CPU the asynchronous part used (the
writer processes' own measurement), which does not depend on that drift.

    .venv/bin/python scripts/bench_overhead.py [--quick] [--only paper|reference] [--rounds N]
                                               [--paper-parallelism P [P ...]] [--path process|aggregate]
                                               [--state int64|string|untyped] [--no-stop-the-world]
                                               [--pin-cpus]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
import pyarrow as pa

import abs
from storage import SnapshotStore


def value_of(idx: np.ndarray) -> np.ndarray:
    return (idx * 7919) % 1000


class KeyValueBatches:
    """Batches (key, value) for global record indices: key = i % keys, value = (i*7919) % 1000."""

    def __init__(self, keys: int) -> None:
        self.keys = keys

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        return pa.RecordBatch.from_arrays([pa.array(idx % self.keys), pa.array(value_of(idx))], names=["key", "value"])


def running_sum(ctx, event):
    total = ctx.state.total
    s = (total.value() or 0) + event["value"]
    total.update(s)


def running_sum_as_text(ctx, event):
    total = ctx.state.total
    total.update("%d" % (int(total.value() or 0) + event["value"]))


# --state of experiment 1: the state's declared type and the process function
STATES = {
    "int64": (pa.int64(), running_sum),  # columnar key groups (abs.columns)
    "string": (pa.string(), running_sum_as_text),  # dict key groups, Arrow-encoded values
    "untyped": (None, running_sum),  # a column of objects, values pickled one by one in the files
}


def build(events: int, keys: int, path: str, batch_size: int, state: str = "int64") -> abs.Dataflow:
    flow = abs.Dataflow(f"bench-{path}")
    src = abs.GeneratorSource(events, num_keys=keys, num_splits=8, batch_size=batch_size, make_batch=KeyValueBatches(keys))
    keyed = flow.source("events", src).key_by("key")
    if path == "process":
        arrow_type, fn = STATES[state]
        keyed.process("sum", fn, state=[abs.ValueState("total", arrow_type)])
    else:
        keyed.aggregate("sum", {"total": ("value", "sum")}, emit="none")
    return flow


def run_once(events: int, keys: int, path: str, parallelism: int, mode: str | None, batch_size: int,
             state: str = "int64", pin_cpus: bool = False) -> tuple[dict, dict | None]:
    root = tempfile.mkdtemp(prefix="abs-bench-")
    try:
        kwargs: dict = {"executor": abs.LocalExecutor(pin_cpus=pin_cpus)}
        if mode is not None:
            kwargs.update(checkpoint=abs.CheckpointConfig(interval=1.0, mode=mode, retained=2), storage=root)
        result = abs.run(build(events, keys, path, batch_size, state), parallelism=parallelism, **kwargs)
        state = None
        if mode is not None:
            store = SnapshotStore.open(root)
            manifest = store.read_manifest(store.latest_checkpoint())
            state = {}
            for kg in manifest.keyed["sum"]["total"]:
                t = store.read_key_group(manifest, "sum", "total", kg)
                state.update(zip(t.column("key").to_pylist(), t.column("value").to_pylist()))
        cps = [c for c in result.completed_checkpoints]
        stats = {
            "throughput": events / result.timings["processing_s"],
            "processing_s": result.timings["processing_s"],
            "checkpoints": len(cps),
            "mean_duration_ms": 1000 * float(np.mean([c.duration for c in cps])) if cps else 0.0,
            "mean_sync_ms": 1000 * float(np.mean([c.sync_time for c in cps])) if cps else 0.0,
            "mean_align_ms": 1000 * float(np.mean([c.alignment_time for c in cps])) if cps else 0.0,
            "mean_written": float(np.mean([c.bytes_written for c in cps])) if cps else 0.0,
            "mean_async_cpu_ms": 1000 * float(np.mean([c.async_cpu for c in cps])) if cps else 0.0,
            # CPU of the snapshots' asynchronous parts per second of processing, all workers
            "async_cpu_per_s": sum(c.async_cpu for c in cps) / result.timings["processing_s"],
        }
        return stats, state
    finally:
        shutil.rmtree(root, ignore_errors=True)


def expected_sums(events: int, keys: int) -> dict:
    idx = np.arange(events, dtype=np.int64)
    sums = np.bincount(idx % keys, weights=value_of(idx), minlength=keys).astype(np.int64)
    return {k: int(v) for k, v in enumerate(sums)}


def paper(args: argparse.Namespace) -> None:
    keys = 1_000_000
    # 20M events: on a machine that processes ~1.3M events/s per worker, runs of 6M lasted ~4 s
    # (a handful of checkpoints, the first of them in the start-up) and paired costs spread
    # over -13..31 %; 20M gives ~15 s and ~15 checkpoints per run
    events = args.events or (4_000_000 if args.quick else 20_000_000)
    modes = (("off", None), ("ABS", "aligned")) + ((("stop-the-world", "stop_the_world"),) if args.stop_the_world else ())
    for p in args.paper_parallelism:
        print(f"\n== 1. {' vs '.join(m for m, _ in reversed(modes))}: {events:,} events, {keys:,} keys in state, parallelism {p}, "
              f"checkpoint every 1 s, path={args.path}" + (f", state={args.state}" if args.path == "process" else "")
              + (", workers pinned to CPUs" if args.pin_cpus else "")
              + f"; {args.rounds} rounds, the modes alternating within each")
        runs: dict[str, list[dict]] = {label: [] for label, _ in modes}
        for _ in range(args.rounds):
            for label, mode in modes:
                stats, _ = run_once(events, keys, args.path, p, mode, args.batch_size, args.state, args.pin_cpus)
                runs[label].append(stats)
        best = {label: max(rs, key=lambda r: r["throughput"]) for label, rs in runs.items()}
        for label, _ in modes:
            stats = best[label]
            tps = sorted(r["throughput"] for r in runs[label])
            print(f"  {label:<15} best {stats['throughput']:>10,.0f} events/s (median {float(np.median(tps)):>10,.0f})  "
                  f"checkpoints {stats['checkpoints']:>3} in {stats['processing_s']:4.1f} s  mean duration "
                  f"{stats['mean_duration_ms']:>6.0f} ms  sync part {stats['mean_sync_ms']:>6.1f} ms  alignment "
                  f"{stats['mean_align_ms']:>6.1f} ms  written/ckpt {stats['mean_written'] / 2**20:>6.2f} MiB", flush=True)
        off = best["off"]["throughput"]
        for label in [m for m, _ in modes if m != "off"]:
            cost = 1 - best[label]["throughput"] / off
            per_round = [1 - a["throughput"] / o["throughput"] for a, o in zip(runs[label], runs["off"])]
            paired = float(np.median(per_round))
            print(f"  throughput cost of {label:<15}: {paired * 100:5.1f} % of 'off' (median of the rounds' paired costs "
                  + ", ".join(f"{c * 100:.0f} %" for c in per_round) + f"; best vs best {cost * 100:.1f} %)"
                  + ("  target <= 5 %: " + ("met" if paired <= 0.05 else "NOT met") if label == "ABS" else ""))
        abs_runs = runs["ABS"]
        cpu = float(np.median([r["async_cpu_per_s"] for r in abs_runs]))
        print(f"  ABS asynchronous part: {float(np.median([r['mean_async_cpu_ms'] for r in abs_runs])):.0f} ms CPU per "
              f"checkpoint, {cpu:.2f} CPU-seconds per second of processing over {p} worker(s) (medians); "
              f"on {os.cpu_count()} cores with {p} busy task thread(s) that CPU is "
              + ("taken from processing" if p >= (os.cpu_count() or 1) else "mostly on the idle core(s)"), flush=True)


def reference(args: argparse.Namespace) -> None:
    events, keys = 2_000_000, 100_000
    expected = expected_sums(events, keys)
    print(f"\n== 2. Reference workload: {events:,} events over {keys:,} keys, keyed running sum, checkpoints every 1 s"
          + (", workers pinned to CPUs" if args.pin_cpus else ""))
    for path, target in (("process", 500_000), ("aggregate", 3_000_000)):
        for p in (1, 2):
            runs = []
            for _ in range(args.rounds):
                stats, state = run_once(events, keys, path, p, "aligned", args.batch_size, pin_cpus=args.pin_cpus)
                if state != expected:
                    print(f"  ERROR: {path} p={p}: final per-key sums differ from the input", file=sys.stderr)
                runs.append((stats, state == expected))
            stats = max((r[0] for r in runs), key=lambda r: r["throughput"])
            exact = all(r[1] for r in runs)
            per_worker = stats["throughput"] / p
            median = float(np.median([r[0]["throughput"] for r in runs])) / p
            print(f"  {path:<9} p={p}: best {stats['throughput']:>11,.0f} events/s ({per_worker:>11,.0f} per worker, "
                  f"median {median:>11,.0f}; target {target:,}: {'met' if per_worker >= target else 'NOT met'})  "
                  f"checkpoints {stats['checkpoints']}  sums exact in every run: {exact}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller paper experiment")
    ap.add_argument("--only", choices=("paper", "reference"))
    ap.add_argument("--path", choices=("process", "aggregate"), default="process", help="operator for experiment 1")
    ap.add_argument("--state", choices=sorted(STATES), default="int64",
                    help="experiment 1, process path: the state's type (int64: a numeric column; untyped: a "
                         "column of objects; string: dict-backed)")
    ap.add_argument("--pin-cpus", action="store_true",
                    help="every run with abs.LocalExecutor(pin_cpus=True): worker i on CPU i mod N")
    ap.add_argument("--no-stop-the-world", dest="stop_the_world", action="store_false",
                    help="experiment 1 without the stop-the-world baseline (slow with dict-backed 1M-key state)")
    ap.add_argument("--batch-size", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=5, help="runs of each configuration, alternating (default 5)")
    ap.add_argument("--paper-parallelism", type=int, nargs="+", default=[1, 2], metavar="P",
                    help="parallelisms of experiment 1 (default: 1 2)")
    ap.add_argument("--events", type=int, default=None,
                    help="events of experiment 1 (default 20M, 4M with --quick); the aggregate path needs "
                         "tens of millions to run for several checkpoint intervals")
    args = ap.parse_args()
    if args.only in (None, "paper"):
        paper(args)
    if args.only in (None, "reference"):
        reference(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
