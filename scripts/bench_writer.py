"""CPU of a snapshot writer per checkpoint, measured in one process (no job, no pipe).

The ABS paper's workload (``bench_overhead.py --only windows``: 1 M int64 keys in 128 key
groups, a checkpoint every second) as one writer at p=2 sees it: 64 key groups of 7,812 keys,
a fixed share of the keys changing between checkpoints (running sums, as the job's). Each
checkpoint's captures go through a pickle round trip, as to the writer process, and are
written with :func:`abs.runtime.writer.write_jobs`; the figure is the writer's CPU time per
checkpoint (``time.process_time``, Arrow's unused memory handed back as the writer process
does), with the bytes written. CPU time barely moves with the machine's load, unlike the job's
throughput; the share of keys a checkpoint captures does move with it (it is the events per
second over the keys), which is why the writer is measured here at fixed shares.

    .venv/bin/python scripts/bench_writer.py [--shares 0.25 0.5 0.9] [--checkpoints 20] [--rounds 2]
                                             [--key-groups 64]
"""
from __future__ import annotations

import argparse
import pickle
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

from abs.columns import Column, KeyOrders
from abs.runtime.messages import WriteJob
from abs.runtime.writer import write_jobs
from abs.state import ColumnDelta
from storage import CheckpointSession, SnapshotStore

KEYS, MAX_PARALLELISM = 1_000_000, 128


def run(share: float, checkpoints: int, key_groups: int, seed: int = 1) -> tuple[list[float], list[int]]:
    """(CPU seconds, bytes written) of each checkpoint after the first (the bases)."""
    root = tempfile.mkdtemp(prefix="abs-bench-writer-")
    try:
        store, orders, session = SnapshotStore.open(root), KeyOrders(), CheckpointSession()
        rng = np.random.default_rng(seed)
        per = KEYS // MAX_PARALLELISM
        columns = []
        for kg in range(key_groups):
            column = Column("q")
            for i in range(per):
                column.insert(kg + MAX_PARALLELISM * i, 0, 1)
            columns.append(column)
        chains: dict[int, list] = {kg: [] for kg in range(key_groups)}
        cpu, written = [], []
        for cid in range(1, checkpoints + 1):
            jobs = []
            for kg, column in enumerate(columns):
                keys = np.frombuffer(column.keys, dtype=np.int64)
                values = np.frombuffer(column.values, dtype=np.int64)
                changed = np.arange(len(keys)) if cid == 1 else np.flatnonzero(rng.random(len(keys)) < share)
                for i, add in zip(changed.tolist(), rng.integers(0, 1000, size=len(changed)).tolist()):
                    column.set(int(keys[i]), int(values[i]) + add, cid + 1)
                captured = column.capture(cid, full=cid == 1)
                jobs.append(WriteJob("sum", "total", kg, chains[kg], ColumnDelta(captured, pa.int64(), "value"), False))
            jobs = pickle.loads(pickle.dumps(jobs, protocol=5))  # as the writer process receives them
            start = time.process_time()
            out = write_jobs(store, orders, cid, jobs, session)
            del jobs
            pa.default_memory_pool().release_unused()
            cpu.append(time.process_time() - start)
            written.append(sum(ref.bytes for chain in out for ref in chain if ref.checkpoint_id == cid))
            chains = dict(enumerate(out))
            session.written(cid, "sum", {"total": dict(chains)})
            session.confirm(cid, "sum")
        return cpu[1:], written[1:]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5, 0.9],
                    help="shares of the keys changed between two checkpoints (default 0.25 0.5 0.9)")
    ap.add_argument("--checkpoints", type=int, default=20, help="checkpoints per run, the bases included (default 20)")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each share, the shares alternating (default 2)")
    ap.add_argument("--key-groups", type=int, default=64, help="key groups of the writer (default 64: p=2 of 128)")
    args = ap.parse_args()
    if not all(0 < s <= 1 for s in args.shares):
        ap.error("--shares must lie in (0, 1]")
    if args.checkpoints < 3 or args.rounds < 1 or not 1 <= args.key_groups <= MAX_PARALLELISM:
        ap.error(f"--checkpoints >= 3, --rounds >= 1 and --key-groups in 1..{MAX_PARALLELISM}")
    print(f"writer CPU per checkpoint: {args.key_groups} key groups of {KEYS // MAX_PARALLELISM:,} int64 keys, "
          f"{args.checkpoints - 1} checkpoints after the bases, {args.rounds} round(s)", flush=True)
    results: dict[float, list[tuple[list[float], list[int]]]] = {s: [] for s in args.shares}
    for _ in range(args.rounds):
        for share in args.shares:
            results[share].append(run(share, args.checkpoints, args.key_groups))
    for share, runs in results.items():
        means = [1000 * float(np.mean(c)) for c, _ in runs]
        medians = [1000 * float(np.median(c)) for c, _ in runs]
        mb = float(np.mean([w for _, ws in runs for w in ws])) / 1e6
        print(f"  {share * 100:3.0f} % of the keys changed: mean {min(means):.1f}-{max(means):.1f} ms, median "
              f"{min(medians):.1f}-{max(medians):.1f} ms of CPU per checkpoint (range over rounds); "
              f"{mb:.2f} MB written per checkpoint", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
