"""Periodic checkpoints of a ``process`` job with string keys (issue 23, target 4).

The job is the reference benchmark's (``scripts/bench_reference.py``, ``build("process", ...)``):
events ``i = 0 .. N-1`` with ``key = "k{i % K}"``, ``value = i % 100``, a keyed running sum in a
``ValueState(int64)``, checkpoints every ``--interval`` seconds to a local directory. With the
default sizes (4 M events, 100 k keys) every key changes between two checkpoints, so every
periodic checkpoint writes the whole state.

Printed per configuration (parallelism), as median (min..max) over every periodic checkpoint of
every round (the final checkpoint, taken after the sources ended, is left out):

* ``duration``: trigger to manifest committed (target: <= 25 % of the interval);
* ``sync``, ``async``: the slowest task's synchronous and asynchronous parts (wall);
* ``async CPU``: the CPU seconds of the asynchronous part, summed over the tasks (the
  uploader threads and the writer processes);
* where the duration goes (``CheckpointStats.phases``): seconds after the trigger at which the
  barrier reached the sources and the keyed tasks, the last snapshot began, the last uploader
  took its snapshot and sent its ack, the driver had every ack, the manifest was committed;
* ``first``: from the first event any worker's source produced to the completion of the
  first checkpoint, one figure per round (target: <= 1.5 s).

Configurations alternate within each round (the machine is shared and its speed drifts).

    .venv/bin/python scripts/bench_checkpoint_interval.py [--rounds N] [--events N] [--keys K]
        [--parallelism P [P ...]] [--interval S] [--root DIR] [--dump FILE]

``--dump FILE`` appends one JSON line per run (its checkpoints' figures), to compare two
versions of the code run alternately.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

import abs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_reference import SPLITS, BATCH, Events, expected_sums, state_matches  # noqa: E402

TARGET_SHARE = 0.25  # of the interval
TARGET_FIRST_S = 1.5
PHASES = (  # CheckpointStats.phases, in the order a checkpoint goes through them
    ("source", "barrier at the sources"),
    ("barrier", "barrier at the keyed tasks"),
    ("snapshot", "snapshot begun (aligned)"),
    ("upload", "uploader took the snapshot"),
    ("uploaded", "ack sent (upload done)"),
    ("acked", "every ack at the driver"),
    ("committed", "manifest committed"),
)


class StampedEvents(Events):
    """:class:`Events` that writes ``time.monotonic()`` (one clock for every process of the
    machine) to ``stamp`` when a process makes its first batch; the first process to do so wins."""

    def __init__(self, keys: int, key_type: str, stamp: str) -> None:
        super().__init__(keys, key_type)
        self.stamp = stamp
        self.stamped = False

    def __getstate__(self) -> dict:  # Events' leaves out the strings it makes again where it runs
        return {**super().__getstate__(), "stamp": self.stamp, "stamped": False}

    def __call__(self, idx: np.ndarray):
        if not self.stamped:
            self.stamped = True
            now = time.monotonic()
            try:
                fd = os.open(self.stamp, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                pass
            else:
                os.write(fd, repr(now).encode())
                os.close(fd)
        return super().__call__(idx)


def running_sum(ctx, event):
    total = ctx.state.total
    total.update((total.value() or 0) + event["value"])


def run_once(events: int, keys: int, parallelism: int, interval: float, expected: np.ndarray,
             root_dir: str | None) -> dict:
    import pyarrow as pa

    root = tempfile.mkdtemp(prefix="abs-ckpt-interval-", dir=root_dir)
    stamp = os.path.join(root, "first-event")
    try:
        flow = abs.Dataflow("ckpt-interval")
        src = abs.GeneratorSource(events, num_keys=keys, num_splits=SPLITS, batch_size=BATCH,
                                  make_batch=StampedEvents(keys, "string", stamp))
        flow.source("events", src).key_by("key").process(
            "sum", running_sum, state=[abs.ValueState("total", pa.int64())])
        storage = os.path.join(root, "store")
        result = abs.run(flow, parallelism=parallelism, storage=storage,
                         checkpoint=abs.CheckpointConfig(interval=interval, retained=2))
        t_end = time.monotonic()
        t_start = t_end - result.duration  # the driver's start, on the same clock
        with open(stamp) as f:
            first_event = float(f.read()) - t_start
        cps = result.completed_checkpoints
        ended = result.timings["startup_s"] + result.timings["processing_s"]
        periodic = [c for c in cps if c.trigger_time < ended]
        first = cps[0].trigger_time + cps[0].duration - first_event if cps else float("nan")
        return {"periodic": periodic, "first": first, "checkpoints": len(cps),
                "verified": state_matches(storage, expected), "processing_s": result.timings["processing_s"]}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def spread(xs: list[float], fmt: str = "{:.3f}") -> str:
    if not xs:
        return "-"
    return f"{fmt.format(float(np.median(xs)))} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--events", type=int, default=4_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--parallelism", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--root", default=None, metavar="DIR", help="directory for the jobs' storage roots")
    ap.add_argument("--dump", default=None, metavar="FILE", help="append each run's figures to FILE as a JSON line")
    args = ap.parse_args()
    if args.rounds < 1 or args.events < 1 or args.keys < 1 or args.interval <= 0:
        ap.error("--rounds, --events, --keys and --interval must be positive")
    print(f"load average at the start {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} cores)",
          flush=True)
    expected = expected_sums(args.events, args.keys)
    runs: dict[int, list[dict]] = {p: [] for p in args.parallelism}
    for r in range(args.rounds):
        for p in args.parallelism:
            got = run_once(args.events, args.keys, p, args.interval, expected, args.root)
            runs[p].append(got)
            if args.dump:
                with open(args.dump, "a") as f:
                    f.write(json.dumps({"parallelism": p, "first": got["first"], "verified": got["verified"],
                                        "checkpoints": [[c.duration, c.sync_time, c.async_time, c.async_cpu,
                                                         c.bytes_written, c.phases] for c in got["periodic"]]})
                            + "\n")
            per = "  ".join(f"{c.duration:.2f}/{c.async_cpu:.2f}" for c in got["periodic"])
            print(f"  round {r + 1} p={p}: first {got['first']:.2f} s; duration/async CPU per checkpoint: {per}",
                  flush=True)
    print(f"\n== {args.events:,} events, {args.keys:,} string keys, checkpoints every {args.interval:g} s; "
          f"{args.rounds} round(s): median (min..max) over the periodic checkpoints", flush=True)
    for p, got in runs.items():
        cps = [c for g in got for c in g["periodic"]]
        dur = [c.duration for c in cps]
        print(f"  p={p}: {len(cps)} periodic checkpoints, {spread([c.bytes_written / 1e3 for c in cps], '{:.0f}')} KB each")
        print(f"    duration  {spread(dur)} s   target <= {TARGET_SHARE * args.interval:.2f} s: "
              f"{'met' if dur and np.median(dur) <= TARGET_SHARE * args.interval else 'NOT met'}")
        print(f"    sync {spread([c.sync_time for c in cps])} s   async {spread([c.async_time for c in cps])} s   "
              f"async CPU {spread([c.async_cpu for c in cps])} s")
        print("    seconds after the trigger, median (min..max), the slowest task's:")
        for name, what in PHASES:
            print(f"      {what:<34} {spread([c.phases[name] for c in cps if name in c.phases])}")
        first = [g["first"] for g in got]
        print(f"    first checkpoint complete after the first event {spread(first, '{:.2f}')} s   target <= "
              f"{TARGET_FIRST_S} s: {'met' if np.median(first) <= TARGET_FIRST_S else 'NOT met'}")
        print(f"    processing {spread([g['processing_s'] for g in got], '{:.2f}')} s   sums verified: "
              f"{sum(g['verified'] for g in got)}/{len(got)}", flush=True)
    print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
