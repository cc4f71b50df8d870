"""Demo: a keyed running count over generated events, parallelism 3, a checkpoint every
second into .abs-demo/ in the checkout (run through scripts/demo, which sets up the
environment). A relative --storage is taken from the directory scripts/demo was run in.

Prints progress while the job runs, then the checkpoints it took, then checks the final
counts against the input. With --spark the same job runs on a local Spark master: its
workers are the tasks of one Spark barrier stage (``--master``, default ``local[N]`` with N
the parallelism).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time

import pyarrow as pa

import abs
from storage import JobMismatchError, SnapshotStore, StorageError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# scripts/demo cd's to the checkout before running this: it passes the directory it was run in
CALLER_DIR = os.environ.get("ABS_DEMO_CALLER_DIR") or os.getcwd()
# what a snapshot root holds at its top (storage/paths.py), besides the drivers' ._probe.* files
ROOT_ENTRIES = {"_job.json", "_committed.json", "checkpoints", "state", "opstate", "channels", "pins"}


def count_events(ctx, event):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    if c % 10 == 0:  # emit every 10th count per key, to keep the output small
        ctx.emit({"key": ctx.key, "count": c})


def build(events: int, keys: int, rate: float | None) -> abs.Dataflow:
    flow = abs.Dataflow("demo-counts")
    src = abs.GeneratorSource(events, num_keys=keys, num_splits=6, batch_size=2048, rate=rate)
    counts = flow.source("events", src).key_by("key").process(
        "count", count_events, state=[abs.ValueState("n", pa.int64())]
    )
    counts.sink("milestones", abs.CollectSink())
    return flow


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def spark_session(master: str):
    """A quiet Spark session on ``master`` whose Python workers use this interpreter."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    print(f"demo: starting Spark ({master}) ...", flush=True)
    spark = (SparkSession.builder.master(master).appName("abs-demo")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit code 2 (argparse prints the whole usage first)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in ``[low, high]`` (a one-line usage error otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"{value} is out of range: give {low}..{high}" if high is not None else f"{value} is below {low}")
        return value
    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text} is below 0")
    return value


def is_url(path: str) -> bool:
    return "://" in path


def shown(path: str) -> str:
    """``path`` as the user can type it where they ran scripts/demo: relative to that directory
    when inside it, else absolute."""
    if is_url(path):
        return path
    rel = os.path.relpath(path, CALLER_DIR)
    return path if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel


def root_owner(storage: str) -> str | None:
    """The job whose snapshots a local directory holds (its ``_job.json``), or None: no such
    file, or one that does not read (the run then says what is wrong with it)."""
    if is_url(storage) or not os.path.isfile(os.path.join(storage, "_job.json")):
        return None
    try:
        job = SnapshotStore.open(storage).read_job()
    except StorageError:
        return None
    name = (job or {}).get("job_name")
    return name if isinstance(name, str) else None


def main(argv: list[str] | None = None) -> int:
    ap = Parser(prog="scripts/demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int_in(1), default=3_000_000, help="events to generate (default %(default)s)")
    ap.add_argument("--keys", type=int_in(1), default=100_000, help="distinct keys (default %(default)s)")
    ap.add_argument("--rate", type=non_negative_float, default=50_000.0,
                    help="events/s per split (6 splits); 0 = unlimited (default %(default)s)")
    max_parallelism = abs.Dataflow("demo-counts").max_parallelism
    ap.add_argument("--parallelism", type=int_in(1, max_parallelism), default=3,
                    help=f"workers, 1..{max_parallelism} (default %(default)s)")
    ap.add_argument("--storage", default=os.path.join(ROOT, ".abs-demo"),
                    help="snapshot root; a relative path is taken from the directory you ran scripts/demo in "
                         "(default: .abs-demo in the checkout). Without --keep, a directory left there by an "
                         "earlier run is deleted first; the snapshots of another job are refused, never deleted")
    ap.add_argument("--keep", action="store_true",
                    help="do not delete --storage first: the job starts from empty state next to the earlier "
                         "snapshots, its checkpoint ids continuing above theirs; garbage collection keeps the "
                         "newest 3 checkpoints, so earlier checkpoints are deleted as new ones complete")
    ap.add_argument("--spark", action="store_true", help="run the workers as a Spark barrier stage")
    ap.add_argument("--master", default=None, help="Spark master with --spark (default local[PARALLELISM])")
    args = ap.parse_args(argv)
    if not is_url(args.storage):
        args.storage = os.path.normpath(os.path.join(CALLER_DIR, os.path.expanduser(args.storage)))
    flow = build(args.events, args.keys, args.rate or None)
    owner = root_owner(args.storage)
    if owner is not None and owner != flow.name:  # never run into, nor delete, another job's snapshots
        ap.error(f"--storage {shown(args.storage)} holds the snapshots of job {owner!r}, not of this demo "
                 f"({flow.name!r}); not touching them: give another directory with --storage, or delete "
                 f"{shown(args.storage)} first if they are no longer needed")
    if not args.keep and os.path.isdir(args.storage):
        strangers = [e for e in os.listdir(args.storage) if e not in ROOT_ENTRIES and not e.startswith("._probe.")]
        if strangers:  # never delete a directory that is not a snapshot root (say --storage .)
            ap.error(f"--storage {shown(args.storage)} holds files that are not snapshots ({strangers[0]}, ...); "
                     "not deleting it: give another path, or --keep")
        print(f"demo: deleting the previous snapshots in {shown(args.storage)} (--keep keeps them)")
        shutil.rmtree(args.storage)
    executor: object = "local"
    if args.spark:
        executor = abs.SparkExecutor(spark_session(args.master or f"local[{args.parallelism}]"),
                                     num_workers=args.parallelism)
    print(f"demo: {args.events:,} events over {args.keys:,} keys, parallelism {args.parallelism}"
          f"{' on Spark (' + executor.spark.sparkContext.master + ')' if args.spark else ''}, "
          f"checkpoints every 1 s into {shown(args.storage)}")
    job = abs.submit(
        flow,
        parallelism=args.parallelism,
        executor=executor,
        checkpoint=abs.CheckpointConfig(interval=1.0, retained=3),
        storage=args.storage,
        restore="fresh" if args.keep else None,  # empty state on purpose next to kept snapshots
    )
    t0 = time.monotonic()
    print(f"demo: starting {args.parallelism} worker processes (each imports pyarrow, forks its snapshot writer "
          "and connects to the others: a few seconds) ...", flush=True)
    phase = "CREATED"
    while job.status in ("CREATED", "RUNNING", "RESTARTING"):
        time.sleep(0.5 if phase == "CREATED" else 1.0)
        m = job.metrics()
        if m["status"] != phase:
            phase = m["status"]
            if phase == "RUNNING":
                print(f"demo: workers running after {time.monotonic() - t0:.1f} s; counting, a checkpoint every second",
                      flush=True)
            elif phase == "RESTARTING":
                print("demo: a worker failed; restarting from the last checkpoint", flush=True)
        if phase != "RUNNING":
            continue
        done = m["records_in"].get("count", 0)
        print(f"  {time.monotonic() - t0:5.1f} s  {done:>10,} events counted  "
              f"checkpoints: {m['completed_checkpoints']} complete, {m['failed_checkpoints']} failed", flush=True)
    try:
        result = job.wait()
    except JobMismatchError as exc:  # a URL root of another job (a local one is refused above)
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 2
    print(f"\njob {result.status} in {result.duration:.1f} s; "
          f"{result.records_in.get('count', 0) / max(result.duration, 1e-9):,.0f} events/s overall")
    print(f"\n{'id':>4} {'at (s)':>7} {'duration':>9} {'alignment':>10} {'sync':>8} {'written':>10} {'full size':>10}")
    for c in result.completed_checkpoints:
        print(f"{c.checkpoint_id:>4} {c.trigger_time:>7.1f} {c.duration * 1000:>7.0f}ms {c.alignment_time * 1000:>8.1f}ms "
              f"{c.sync_time * 1000:>6.1f}ms {human(c.bytes_written):>10} {human(c.full_size):>10}")
    if result.failed_checkpoints:
        print(f"failed checkpoints: {result.failed_checkpoints}")
    out = result.collected("milestones")
    expected = args.events // args.keys // 10 * args.keys if args.events % args.keys == 0 else None
    print(f"\nmilestones emitted: {out.num_rows:,}" + (f" (expected {expected:,})" if expected is not None else ""))
    print(f"inspect the snapshots: abs-snapshot ls {shlex.quote(shown(args.storage))}")
    if expected is not None and out.num_rows != expected:
        print("MISMATCH: output does not match the input", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
