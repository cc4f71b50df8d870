"""Live reconfiguration benchmark: rescaling a running job 1 -> 2 and 2 -> 1 workers and moving
half its key groups, live (three strategies) against stop-and-restart, on the reference
workload with a latency tracker.

The job: string keys ``k{i % keys}``, a keyed running sum (``process``, ValueState int64),
checkpoints every second, parallelism 2, input paced at ``--rate`` events/s so that latency
means something (a saturated job only measures its queues). Every record carries the time its
source emitted it; the sink records, per batch, when it arrived. Per run the job fills its
state, runs steady for a few seconds, is reconfigured, runs steady again:

* ``stop-and-restart``: a checkpoint, cancel, and a new job restored from it (today's way to
  change where state lives; the key groups stay at their default owners, so this is the cost
  of any restart-based reconfiguration);
* ``all_at_once``, ``batched`` (8 key groups per step), ``fluid`` (one per step): for
  ``--changes move``, half the key groups (half of each worker's, swapped) move with
  ``JobHandle.rebalance``; for ``1to2`` and ``2to1``, ``JobHandle.rescale`` starts a worker
  (which joins the running dataflow) or drains one and stops it.

Records replayed after a restart are stamped when the restored job emits them again, so the
latency columns of stop-and-restart leave out its wait; its stall column has it.

Printed per run: the longest time the output made no progress (from the reconfiguration's
start to 3 s after its end; beside it the longest in the 3 s before, the steady state's own),
the max and p99 latency in that span against the steady state's p99 (before it, and 3-6 s
after its end: a rescale changes the steady state itself, e.g. records crossing processes at
p=2 wait longer than at p=1; the target uses the larger), the reconfiguration's duration, bytes handed over against the moved key groups'
full size in the checkpoint they build on, and throughput during it. A plot per run (latency
per 100-ms window over time) is saved next to the table (``--plots DIR``; needs matplotlib).
Targets: live longest stall <= 1/10 of stop-and-restart's; fluid/batched max latency <= 3x the
steady p99; bytes moved <= 1.2x the state changed since the last checkpoint (here: the moved
key groups' changes, reported against their full size).

    .venv/bin/python scripts/bench_rescale.py [--keys 100000] [--rate 40000] [--rounds 1]
        [--changes move,1to2,2to1]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import sys
import tempfile
import time
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

import abs

M = 128
STEADY_S = 3.0


class Stamped(abs.Source):
    """A source whose records carry ``t``: the wall-clock time their batch was emitted."""

    def __init__(self, inner: abs.Source) -> None:
        self.inner = inner

    def splits(self) -> list[str]:
        return self.inner.splits()

    def initial_offset(self, split: str) -> Any:
        return self.inner.initial_offset(split)

    def create_reader(self, splits: Mapping[str, Any], subtask: int, parallelism: int) -> abs.SourceReader:
        return _StampedReader(self.inner.create_reader(splits, subtask, parallelism))


class _StampedReader(abs.SourceReader):
    def __init__(self, inner: abs.SourceReader) -> None:
        self.inner = inner

    def poll(self) -> Any:
        batch = self.inner.poll()
        if batch is None or batch is abs.END or not batch.num_rows:
            return batch
        return batch.append_column("t", pa.array(np.full(batch.num_rows, time.time())))

    def offsets(self) -> dict:
        return self.inner.offsets()

    def wait_hint(self) -> float:
        return self.inner.wait_hint()

    def notify_checkpoint_complete(self, checkpoint_id: int, offsets: Mapping[str, Any]) -> None:
        self.inner.notify_checkpoint_complete(checkpoint_id, offsets)

    def close(self) -> None:
        self.inner.close()


class Events:
    def __init__(self, keys: int) -> None:
        self.keys = keys

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        keys = pa.array([f"k{k}" for k in (idx % self.keys).tolist()])
        return pa.RecordBatch.from_arrays([keys, pa.array(idx % 100)], names=["key", "value"])


def running_sum(ctx, event):
    total = ctx.state.total
    s = (total.value() or 0) + event["value"]
    total.update(s)
    ctx.emit({"t": event["t"]})


class LatencySink(abs.Sink):
    """Appends (arrival time, latency) of every record to a file per writer under ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def create_writer(self, subtask: int, parallelism: int, restored_transactions: Any = ()) -> abs.SinkWriter:
        return _LatencyWriter(os.path.join(self.path, f"lat-{os.getpid()}-{subtask}.bin"))


class _LatencyWriter(abs.SinkWriter):
    def __init__(self, path: str) -> None:
        self.f = open(path, "ab", buffering=0)

    def write(self, batch: pa.RecordBatch) -> None:
        now = time.time()
        t = batch.column("t").to_numpy()
        self.f.write(np.column_stack([np.full(len(t), now), now - t]).tobytes())

    def pre_commit(self, checkpoint_id: int) -> Any:
        return None

    def commit(self, checkpoint_id: int, transactions: Any) -> None:
        pass

    def close(self) -> None:
        self.f.close()


def build(keys: int, rate: float, lat_dir: str) -> abs.Dataflow:
    flow = abs.Dataflow("bench-rescale", max_parallelism=M)
    src = abs.GeneratorSource(None, num_keys=keys, num_splits=4, batch_size=500, rate=rate / 4, make_batch=Events(keys))
    flow.source("events", Stamped(src)).key_by("key").process(
        "sum", running_sum, state=[abs.ValueState("total", pa.int64())]).sink("lat", LatencySink(lat_dir))
    return flow


def swap_halves(p: int = 2) -> dict[int, int]:
    """Half of each worker's key groups to the next worker."""
    owners = abs.reconfig.Assignment.initial(M, p)
    change = {}
    for w in range(p):
        mine = owners.key_groups_of(w)
        for kg in mine[: len(mine) // 2]:
            change[kg] = (w + 1) % p
    return change


def _wait_records(handle: Any, n: int, timeout: float = 300) -> None:
    t0 = time.monotonic()
    while handle.metrics()["records_in"].get("sum", 0) < n:
        if time.monotonic() - t0 > timeout:
            raise RuntimeError("the job did not fill its state in time")
        time.sleep(0.05)


CHANGES = {"move": (2, 2), "1to2": (1, 2), "2to1": (2, 1)}  # workers before, after


def one_run(strategy: str, keys: int, rate: float, change: str = "move") -> dict:
    p0, p1 = CHANGES[change]
    root = tempfile.mkdtemp(prefix="abs-bench-rescale-")
    lat_dir = os.path.join(root, "lat")
    os.makedirs(lat_dir)
    flow = build(keys, rate, lat_dir)
    cfg = abs.CheckpointConfig(interval=1.0, retained=2)
    store = os.path.join(root, "snap")
    out: dict = {"strategy": strategy, "change": change}
    handle = abs.submit(flow, parallelism=p0, checkpoint=cfg, storage=store)
    try:
        _wait_records(handle, keys + 2 * 500 * 4)  # every key in state
        handle.trigger_checkpoint()
        time.sleep(STEADY_S)
        t_start = time.time()
        if strategy == "stop-and-restart":
            handle.trigger_checkpoint()
            handle.cancel()
            handle = abs.submit(flow, parallelism=p1, checkpoint=cfg, storage=store, restore="latest")
            _wait_records(handle, 1)
            out["bytes_moved"] = out["full_bytes"] = None
        else:
            batch = 8 if strategy == "batched" else None
            if change == "move":
                rec = handle.rebalance(swap_halves(), strategy=strategy, batch=batch)
            else:
                rec = handle.rescale(p1, strategy=strategy, batch=batch)
            out["bytes_moved"] = rec.bytes_moved
            out["full_bytes"] = sum(s.full_bytes for s in rec.steps)
            out["steps"] = len(rec.steps)
        t_end = time.time()
        time.sleep(2 * STEADY_S)  # the reconfiguration's aftermath, then the new steady state
    finally:
        try:
            handle.cancel()
        except Exception:  # noqa: BLE001 - already ended
            pass
    rows = np.concatenate([np.fromfile(f, dtype=np.float64).reshape(-1, 2) for f in glob.glob(f"{lat_dir}/*.bin")])
    shutil.rmtree(root, ignore_errors=True)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    arrive, lat = rows[:, 0], rows[:, 1]
    steady = (arrive >= t_start - STEADY_S + 0.5) & (arrive < t_start)
    after = (arrive >= t_end + STEADY_S) & (arrive < t_end + 2 * STEADY_S)
    span = (arrive >= t_start) & (arrive < t_end + STEADY_S)
    times = np.unique(arrive[span])
    gaps = np.diff(np.concatenate([[t_start], times]))
    before = np.unique(arrive[(arrive >= t_start - STEADY_S) & (arrive < t_start)])
    out.update(
        duration=t_end - t_start,
        steady_p99=float(np.percentile(lat[steady], 99)),
        after_p99=float(np.percentile(lat[after], 99)) if after.any() else float("nan"),
        steady_p50=float(np.percentile(lat[steady], 50)),
        p99=float(np.percentile(lat[span], 99)),
        max=float(lat[span].max()),
        stall=float(gaps.max()) if len(gaps) else float("nan"),
        steady_stall=float(np.diff(before).max()) if len(before) > 1 else float("nan"),
        throughput=float(((arrive >= t_start) & (arrive < max(t_end, t_start + 0.1))).sum() / max(t_end - t_start, 0.1)),
        series=(arrive - t_start, lat),
    )
    return out


def plot(run: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (no plot: install matplotlib, e.g. pip install matplotlib)")
        return
    t, lat = run["series"]
    w = np.floor(t / 0.1).astype(int)
    win = np.unique(w)
    p50 = [np.percentile(lat[w == i], 50) * 1000 for i in win]
    p99 = [np.percentile(lat[w == i], 99) * 1000 for i in win]
    mx = [lat[w == i].max() * 1000 for i in win]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    x = win * 0.1
    ax.plot(x, mx, label="max", lw=0.8)
    ax.plot(x, p99, label="p99", lw=0.8)
    ax.plot(x, p50, label="p50", lw=0.8)
    ax.axvspan(0, run["duration"], color="grey", alpha=0.2, label="reconfiguration")
    ax.set_yscale("log")
    ax.set_xlabel("seconds from the reconfiguration's start")
    ax.set_ylabel("latency per 100 ms window (ms)")
    what = {"move": "half the key groups moved", "1to2": "rescale 1 -> 2 workers", "2to1": "rescale 2 -> 1 workers"}
    ax.set_title(f"{run['strategy']}: {what[run['change']]}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--rate", type=float, default=40_000, help="input events per second (all splits)")
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds of the four runs")
    ap.add_argument("--plots", default=None, help="directory for the PNG plots (default: a temporary one)")
    ap.add_argument("--changes", default="move,1to2,2to1", help="comma-separated: move, 1to2, 2to1")
    args = ap.parse_args()
    plots = args.plots or tempfile.mkdtemp(prefix="abs-bench-rescale-plots-")
    os.makedirs(plots, exist_ok=True)
    changes = args.changes.split(",")
    for change in changes:
        if change not in CHANGES:
            ap.error(f"--changes: {change!r} is not one of {', '.join(CHANGES)}")
    strategies = ["stop-and-restart", "all_at_once", "batched", "fluid"]
    print(f"== {', '.join(changes)} with {M} key groups: {args.keys:,} string keys in state, input {args.rate:,.0f} "
          f"events/s, checkpoints every 1 s; {args.rounds} interleaved round(s); plots in {plots}", flush=True)
    runs: dict[tuple, list[dict]] = {(c, s): [] for c in changes for s in strategies}
    for r in range(args.rounds):
        for c in changes:
            for s in strategies:
                run = one_run(s, args.keys, args.rate, c)
                runs[(c, s)].append(run)
                plot(run, os.path.join(plots, f"rescale-{c}-{s}-{r + 1}.png"))
    for c in changes:
        p0, p1 = CHANGES[c]
        print(f"-- {c}: {'half the key groups move between 2 workers' if c == 'move' else f'{p0} -> {p1} workers'}")
        print(f"  {'strategy':<17}{'stall ms':>9}{'steady stall':>13}{'max ms':>9}{'p99 ms':>9}{'steady p99':>11}"
              f"{'after p99':>10}{'duration s':>11}{'moved KB':>10}{'full KB':>9}{'events/s during':>16}")
        for s in strategies:
            for run in runs[(c, s)]:
                moved = "-" if run["bytes_moved"] is None else f"{run['bytes_moved'] / 1024:,.0f}"
                full = "-" if run["full_bytes"] is None else f"{run['full_bytes'] / 1024:,.0f}"
                print(f"  {s:<17}{run['stall'] * 1000:>9.0f}{run['steady_stall'] * 1000:>13.0f}"
                      f"{run['max'] * 1000:>9.0f}{run['p99'] * 1000:>9.0f}"
                      f"{run['steady_p99'] * 1000:>11.0f}{run['after_p99'] * 1000:>10.0f}{run['duration']:>11.2f}"
                      f"{moved:>10}{full:>9}"
                      f"{run['throughput']:>16,.0f}")
        restart_stall = float(np.median([r["stall"] for r in runs[(c, "stop-and-restart")]]))
        for s in strategies[1:]:
            stall = float(np.median([r["stall"] for r in runs[(c, s)]]))
            ratio = stall / restart_stall if restart_stall else float("nan")
            line = (f"  {s}: longest stall {ratio:.3f} of stop-and-restart's (target <= 0.1: "
                    f"{'met' if ratio <= 0.1 else 'NOT met'})")
            if s in ("batched", "fluid"):
                lat = float(np.median([r["max"] / np.nanmax([r["steady_p99"], r["after_p99"]]) for r in runs[(c, s)]]))
                line += (f"; max latency {lat:.1f}x the steady p99, the larger of before and after (target <= 3: "
                         f"{'met' if lat <= 3 else 'NOT met'})")
            moved = [r["bytes_moved"] / r["full_bytes"] for r in runs[(c, s)] if r["full_bytes"]]
            if moved:
                line += f"; bytes moved {float(np.median(moved)):.2f}x the moved key groups' full size"
            print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
