"""The vectorized aggregate's processing rate before and after its key groups move while the
job runs (one run; the machine is shared and noisy: rates are compared within the run).

The job: ``--keys`` string keys ``k<i>`` (the reference workload's), ``aggregate`` sum and
count, ``emit="none"``, parallelism 2, checkpoints every second, the source unpaced (the
aggregate runs flat out). Once every key is in state, the rate (records into the aggregate
per second, from the workers' counts) is taken over ``--window`` seconds; then half of each
worker's key groups move to the other (``JobHandle.rebalance``, ``--strategy``), and the rate
is taken again over the same span, then once more after a second window (the steady state after
the move). Printed: the rates, their ratio to the rate before (target: >= 0.9, the moved key
groups keep the columnar store's speed), the reconfiguration's duration and bytes handed over.

    .venv/bin/python scripts/bench_rescale_aggregate.py [--keys 100000] [--window 5] [--strategy all_at_once]
                                                        [--rounds 2]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

import abs

M = 128


class StringSums:
    """Batches of ``k<i % keys>`` keys and ``i % 100`` values."""

    def __init__(self, keys: int) -> None:
        self.keys = keys

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        k = idx % self.keys
        return pa.record_batch({"key": pa.array(np.char.add("k", k.astype("U")).astype(object)),
                                "value": pa.array(idx % 100, pa.int64())})


def rate(handle: abs.JobHandle, seconds: float) -> float:
    """Records into the aggregate per second over ``seconds`` (the workers' counts reach the
    driver every 0.5 s: long windows keep that granularity small)."""
    n0, t0 = handle.metrics()["records_in"].get("sum", 0), time.monotonic()
    time.sleep(seconds)
    n1, t1 = handle.metrics()["records_in"].get("sum", 0), time.monotonic()
    return (n1 - n0) / (t1 - t0)


def one_run(keys: int, window: float, strategy: str) -> dict:
    flow = abs.Dataflow("bench-rescale-aggregate", max_parallelism=M)
    src = abs.GeneratorSource(1 << 50, num_keys=keys, num_splits=8, batch_size=8192, make_batch=StringSums(keys))
    flow.source("events", src).key_by("key").aggregate("sum", {"total": ("value", "sum"), "n": ("value", "count")},
                                                       emit="none")
    root = tempfile.mkdtemp(prefix="abs-bench-rescale-aggregate-")
    handle = abs.submit(flow, parallelism=2, storage=root, checkpoint=abs.CheckpointConfig(interval=1.0, retained=2))
    try:
        t0 = time.monotonic()
        while handle.metrics()["records_in"].get("sum", 0) < 3 * keys or time.monotonic() - t0 < 3:
            time.sleep(0.2)
        before = rate(handle, window)
        owners = handle.assignment().owners
        # half of each worker's key groups to the other worker
        moves = {}
        for w in (0, 1):
            mine = [g for g, o in enumerate(owners) if o == w]
            moves.update({g: 1 - w for g in mine[: len(mine) // 2]})
        t = time.monotonic()
        rec = handle.rebalance(moves, strategy=strategy, batch=8 if strategy == "batched" else None)
        took = time.monotonic() - t
        after = rate(handle, window)
        later = rate(handle, window)
        return {"before": before, "after": after, "later": later, "duration": took,
                "bytes_moved": sum(s.bytes_moved for s in rec.steps), "moved": len(moves), "status": rec.status}
    finally:
        handle.cancel()
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--window", type=float, default=5.0, help="seconds of each rate window")
    ap.add_argument("--strategy", default="all_at_once", choices=["all_at_once", "batched", "fluid"])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    print(f"== aggregate (sum, count) over {args.keys:,} string keys at parallelism 2, {M} key groups, checkpoints "
          f"every 1 s: half of each worker's key groups move ({args.strategy}); rates over {args.window:.0f}-s windows",
          flush=True)
    runs = []
    for r in range(args.rounds):
        run = one_run(args.keys, args.window, args.strategy)
        runs.append(run)
        print(f"  round {r + 1}: {run['status']}, {run['moved']} key groups in {run['duration']:.2f} s, "
              f"{run['bytes_moved'] / 1e6:.1f} MB handed over; events/s before {run['before']:,.0f}, "
              f"after {run['after']:,.0f} ({run['after'] / run['before']:.2f}), "
              f"later {run['later']:,.0f} ({run['later'] / run['before']:.2f})", flush=True)
    ratio = float(np.median([min(r["after"], r["later"]) / r["before"] for r in runs]))
    print(f"  rate after the move / before (the lower of the two windows after, median over rounds): {ratio:.2f}  "
          f"target >= 0.9: {'met' if ratio >= 0.9 else 'NOT met'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
