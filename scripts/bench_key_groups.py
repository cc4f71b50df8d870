"""What a large max_parallelism costs: a job's checkpoint and restore at 128, 4,096 and 32,768
key groups, against 128.

Flink users set a large max parallelism (up to 32,768) to be free to rescale later; the state
is then cut into key groups of a few keys each, and whatever a snapshot does per key group
(capture, pickle to the writer, plan, encode, reference, restore) is paid tens of thousands of
times. Workload: the reference job (``bench_reference.build``: a keyed running sum, ``process``
with a ``ValueState`` and ``aggregate``) over K string keys, one event per key, p=1, no
periodic checkpoint: the final checkpoint writes every key group whole; then a restore of it
(launch to ``run()`` returning, 10 more events, its final checkpoint; ``startup`` is launch to
the first event, which holds the restore). Configurations alternate within each round; medians over rounds, each beside the
same path at max_parallelism 128 (measured in the same rounds).

    .venv/bin/python scripts/bench_key_groups.py [--keys 400000] [--max-parallelism 128 4096 32768]
                                                 [--paths process aggregate] [--rounds 3] [--root DIR]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import abs  # noqa: E402
from bench_reference import build  # noqa: E402


def one(path: str, keys: int, max_parallelism: int, root_dir: str | None) -> dict[str, float]:
    root = tempfile.mkdtemp(prefix="abs-bench-kg-", dir=root_dir)
    try:
        first = abs.run(build(path, keys, keys, "string", max_parallelism), parallelism=1, storage=root,
                        checkpoint=abs.CheckpointConfig(interval=None))
        cp = first.completed_checkpoints[-1]
        t0 = time.perf_counter()
        second = abs.run(build(path, keys + 10, keys, "string", max_parallelism), parallelism=1, storage=root,
                         restore="latest", checkpoint=abs.CheckpointConfig(interval=None))
        restore = time.perf_counter() - t0
        if second.restored_from != cp.checkpoint_id:
            raise RuntimeError(f"restored {second.restored_from}, expected checkpoint {cp.checkpoint_id}")
        return {"checkpoint s": cp.duration, "checkpoint CPU s": cp.async_cpu, "restore run s": restore,
                "restore startup s": second.timings["startup_s"], "restore finishing s": second.timings["finishing_s"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=400_000)
    ap.add_argument("--max-parallelism", type=int, nargs="+", default=[128, 4096, 32768], metavar="M")
    ap.add_argument("--paths", nargs="+", choices=("process", "aggregate"), default=["process", "aggregate"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root", default=None, metavar="DIR", help="directory for the jobs' storage roots")
    args = ap.parse_args()
    mps = sorted(set(args.max_parallelism) | {128})
    if args.rounds < 1 or args.keys < 1 or any(not 1 <= m <= 32768 for m in mps):
        ap.error("--rounds and --keys >= 1, --max-parallelism in 1..32768")
    print(f"{args.keys:,} string keys, p=1, {args.rounds} round(s); median (min..max) per configuration", flush=True)
    got: dict[tuple[str, int], list[dict]] = {(p, m): [] for p in args.paths for m in mps}
    for r in range(args.rounds):
        for m in mps:
            for path in args.paths:
                got[(path, m)].append(one(path, args.keys, m, args.root))
        print(f"  round {r + 1} done", flush=True)
    for path in args.paths:
        print(f"\n== {path}")
        base = got[(path, 128)]
        for m in mps:
            runs = got[(path, m)]
            parts = []
            for name in ("checkpoint s", "checkpoint CPU s", "restore run s", "restore startup s", "restore finishing s"):
                xs = [run[name] for run in runs]
                ratio = float(np.median([x / b[name] for x, b in zip(xs, base)]))
                parts.append(f"{name} {np.median(xs):.2f} ({min(xs):.2f}..{max(xs):.2f})"
                             + (f" = {ratio:.1f}x" if m != 128 else ""))
            print(f"  max_parallelism {m:>6,}: " + ";  ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
