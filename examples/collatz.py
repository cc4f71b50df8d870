"""Collatz steps with a loop: every number goes round until it reaches 1; the loop's output
is ``(start, steps)``. Runs with checkpoints every 0.2 s into a new temporary directory (or
into STORAGE when given; a STORAGE that already holds checkpoints is started from empty state
all the same, ``restore="fresh"``, its checkpoint ids continuing above the ones there), kills
nothing, checks every answer and prints where the snapshots are.

    .venv/bin/python examples/collatz.py [STORAGE] [--count N] [--workers P]
"""
from __future__ import annotations

import argparse
import tempfile

import pyarrow as pa

import abs


def numbers(count: int, batch_size: int = 256) -> abs.GeneratorSource:
    """``start = value = 1..count``, ``steps = 0``."""
    def make(idx):
        return pa.RecordBatch.from_arrays([pa.array(idx + 1), pa.array(idx + 1), pa.array(idx * 0)],
                                          names=["start", "value", "steps"])
    return abs.GeneratorSource(count=count, make_batch=make, batch_size=batch_size)


def step(r: dict) -> dict:
    v = r["value"]
    if v == 1:
        return r  # done: leaves the loop
    return {"start": r["start"], "value": v // 2 if v % 2 == 0 else 3 * v + 1, "steps": r["steps"] + 1}


def build(source: abs.Source, sink: abs.Sink) -> abs.Dataflow:
    flow = abs.Dataflow("collatz")

    def body(loop: abs.Stream):
        moved = loop.map(step, uid="step")
        return moved.filter(lambda r: r["value"] != 1, uid="again").rebalance(), moved.filter(
            lambda r: r["value"] == 1, uid="done")

    flow.source("numbers", source).iterate("collatz", body).sink("out", sink)
    return flow


def steps_of(n: int) -> int:
    k = 0
    while n != 1:
        n, k = (n // 2 if n % 2 == 0 else 3 * n + 1), k + 1
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage", nargs="?", default=None,
                    help="snapshot root (default: a new temporary directory); its earlier checkpoints are kept")
    ap.add_argument("--count", type=int, default=5000)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    flow = build(numbers(args.count), abs.CollectSink())
    storage = args.storage or tempfile.mkdtemp(prefix="abs-collatz-")
    result = abs.run(flow, parallelism=args.workers, storage=storage,
                     checkpoint=abs.CheckpointConfig(interval=0.2), restore="fresh")
    got = {r["start"]: r["steps"] for r in result.collected("out").to_pylist()}
    wrong = [n for n in range(1, args.count + 1) if got.get(n) != steps_of(n)]
    print(f"{len(got)} numbers, {len(result.completed_checkpoints)} checkpoints, "
          f"{'all steps right' if not wrong else f'{len(wrong)} wrong'}")
    print(f"snapshots: abs-snapshot ls {storage}")


if __name__ == "__main__":
    main()
