"""Loop benchmark (issue target 7b): the cost of checkpointing a cyclic job.

Two loop jobs of ``examples/``: Collatz steps (a stateless body; every number goes round
until it reaches 1) and connected components by label propagation (keyed state in the loop).
Each runs without checkpoints and with a checkpoint every second (local disk), alternating
within every round (the machine is shared and its speed drifts). Printed per job: records
processed per second in the loop (the head's records in over the run), median [min - max]
over the rounds, the cost of checkpointing as 1 - rate(checkpoints) / rate(none) from the
medians (target: <= 10 %), and per checkpoint the records logged on the feedback edge and
the bytes written.

    .venv/bin/python scripts/bench_loops.py [--rounds N] [--count N] [--nodes N --edges N]
"""
from __future__ import annotations

import argparse
import importlib.util
import pathlib
import shutil
import statistics
import tempfile
import time

import abs
from storage import SnapshotStore

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGET = 0.10


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def one_run(build, head: str, storage: str | None, parallelism: int) -> dict:
    options = {}
    if storage is not None:
        shutil.rmtree(storage, ignore_errors=True)
        options = {"storage": storage, "checkpoint": abs.CheckpointConfig(interval=1.0)}
    t0 = time.perf_counter()
    result = abs.run(build(), parallelism=parallelism, **options)
    seconds = time.perf_counter() - t0
    out = {"rate": result.records_in[head] / seconds, "seconds": seconds, "checkpoints": 0}
    if storage is not None:
        store = SnapshotStore.open(storage)
        manifests = [store.read_manifest(c) for c in store.list_checkpoints()]
        stats = result.completed_checkpoints
        out.update(checkpoints=len(stats),
                   logged=statistics.mean(m.stats.get("loop_records", 0) for m in manifests) if manifests else 0,
                   bytes=statistics.mean(s.bytes_written for s in stats) if stats else 0,
                   duration=statistics.median(s.duration for s in stats) if stats else 0)
    return out


def span(values: list[float], fmt: str) -> str:
    return f"{format(statistics.median(values), fmt)} [{format(min(values), fmt)} - {format(max(values), fmt)}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count", type=int, default=20_000, help="Collatz numbers")
    ap.add_argument("--nodes", type=int, default=60_000)
    ap.add_argument("--edges", type=int, default=50_000)
    ap.add_argument("--parallelism", type=int, default=2)
    args = ap.parse_args()
    collatz, cc = example("collatz"), example("connected_components")
    jobs = {
        "collatz": (lambda: collatz.build(collatz.numbers(args.count), abs.CollectSink()), "collatz"),
        "components": (lambda: cc.build(cc.random_edges(args.nodes, args.edges), abs.CollectSink()), "propagation"),
    }
    tmp = tempfile.mkdtemp(prefix="bench-loops-")
    runs: dict = {(j, m): [] for j in jobs for m in ("none", "checkpoints")}
    try:
        for r in range(args.rounds):
            for job, (build, head) in jobs.items():
                order = ("none", "checkpoints") if r % 2 == 0 else ("checkpoints", "none")
                for mode in order:
                    res = one_run(build, head, None if mode == "none" else f"{tmp}/{job}", args.parallelism)
                    runs[(job, mode)].append(res)
                    print(f"round {r + 1} {job:10s} {mode:11s} {res['rate'] / 1e3:7.1f} k rec/s in {res['seconds']:.2f} s"
                          + (f", {res['checkpoints']} checkpoints" if mode != "none" else ""), flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\np={args.parallelism}, {args.rounds} rounds; loop records per second, median [min - max]")
    for job in jobs:
        none = [x["rate"] for x in runs[(job, "none")]]
        ckpt = [x["rate"] for x in runs[(job, "checkpoints")]]
        cost = 1 - statistics.median(ckpt) / statistics.median(none)
        c = runs[(job, "checkpoints")]
        print(f"{job}: none {span([v / 1e3 for v in none], '.1f')} k/s; checkpoints every 1 s "
              f"{span([v / 1e3 for v in ckpt], '.1f')} k/s; cost {cost * 100:.1f} % (target <= {TARGET * 100:.0f} %: "
              f"{'met' if cost <= TARGET else 'NOT met'}); {statistics.mean(x['checkpoints'] for x in c):.1f} checkpoints "
              f"per run, {statistics.mean(x['logged'] for x in c):.0f} records logged and "
              f"{statistics.mean(x['bytes'] for x in c) / 1e3:.0f} KB written per checkpoint, median duration "
              f"{statistics.median(x['duration'] for x in c) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
