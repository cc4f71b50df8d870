"""Reference benchmark: issue 23's headline workload, each figure beside its target.

The workload: events ``i = 0 .. N-1`` with ``key = "k{i % K}"`` (string keys; integer keys
``i % K`` as a second row) and ``value = i % 100``, a keyed running sum, checkpoints every
1 s, parallelism 1 and 2, and the final per-key sums read back from the last checkpoint and
checked exactly. N is ``--events`` (default 2,000,000), raised to K when K is larger, so
that every key is in state.

1. ``process`` with a ``ValueState`` (one Python call per record). Two rates: *end-to-end*
   (``abs.run`` called to ``abs.run`` returned: start-up, processing, final checkpoint;
   what a user waits for) and *processing* (the workers' start to the sources' end). Beside
   them, in the same process and the same round, a plain Python dict loop over the same
   events (the keys and values already Python lists; only the loop is timed).
2. ``aggregate`` (vectorized, ``emit="none"``) on the same events, against pyarrow's
   ``group_by(...).aggregate([("value", "sum")])`` (``use_threads=False``: one core, as one
   worker has) over a table of the very batches the job's source produces.
3. Checkpoint cost with large state: one job per row whose only checkpoint is the final one,
   taken once the sources are done, with every key of the state changed (a full image of
   K keys, nothing else running): its duration (trigger to manifest committed), ``aggregate``
   against ``process`` at the same K.

   Peak memory (issue 23 target 8) of the ``process`` job at p=1 with string keys: in every
   round one more such job runs alone in a fresh interpreter (``--memory-job``: the
   benchmark's own data would otherwise sit in the driver and in the workers forked from
   it), and a thread here samples the proportional set size (``Pss`` of
   ``/proc/<pid>/smaps_rollup``) of that driver and of every process below it (workers,
   snapshot writers) every 20 ms, from its start until ``abs.run`` returned; printed: the
   peak of the sum. Linux only (elsewhere the row says why it is missing). PSS shares each
   page among the processes that map it, the machine's other processes included: on a
   machine where other Python processes map the same pyarrow and numpy libraries the figure
   is lower than on an idle one (reference workload: 115-126 MB on a busy machine; 148-156 MB
   counting every library page as the job's own, 165-171 MB before the driver warmed pyarrow
   before its forks, the tasks handed Arrow's unused memory back at each checkpoint and new
   string keys went to the writer as Arrow arrays). Hence a second row, the figure of an idle
   machine whatever runs beside: the peak of the job's *distinct pages*, every physical page
   that the driver, the worker or the writer maps (page frame numbers from
   ``/proc/<pid>/pagemap``) counted once, however many of the job's processes map it and
   whatever other process maps it too; what the job's summed PSS is where no other process
   shares its pages. Sampled every 0.2 s (reading the page tables costs tens of ms), so its
   peak may miss a shorter one. Reading page frame numbers needs CAP_SYS_ADMIN (root);
   without it the row says it was not measured.

4. ``--deltas`` (issue 23 target 5): the storage alone, no job. A state of K string keys in
   128 key groups (a ValueState's schema: ``key`` string, ``value`` int64) is written as a full
   checkpoint (every key group's image, packed), then 1 % of the keys, drawn at random, change
   and their rows are written as the next checkpoint's deltas. Printed per K: the delta's
   bytes against the full checkpoint's (``stats.bytes_written`` of each: state files, the
   manifests beside), the fixed cost per changed key group (the delta's bytes minus those of
   the same rows encoded as one stream, over the key groups changed), the manifests' sizes,
   what each checkpoint writes in all (state files and manifest: what target 5 counts), the
   write time, and the time to commit (encode and write) and to read (parse, on a fresh
   store) the delta checkpoint's manifest; for the format-5 layout (``share_below = 0``: a
   stream per key group) and shared ranges (format 6 and later: small files share a stream),
   interleaved in every round. Every key group of the delta checkpoint is read back and
   checked.

The machine is shared and noisy: every configuration runs once per round and the rounds
interleave them, so that each round's figures share the machine's momentary speed; the
ratios against the dict loop and group_by are taken within a round. Printed: medians and
the range (min..max) over the rounds.

    .venv/bin/python scripts/bench_reference.py [--quick] [--rounds N] [--events N] [--keys K [K ...]]
        [--key-types string int] [--parallelism P [P ...]] [--checkpoint-keys K [K ...]]
        [--only process aggregate checkpoint] [--root DIR]
    .venv/bin/python scripts/bench_reference.py --deltas [--rounds N] [--delta-keys K [K ...]] [--root DIR]

``--quick`` is a smoke test (tiny sizes, one round: its figures mean nothing).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import abs
from abscore.keygroups import key_groups
from storage import Manifest, SnapshotStore
from storage.format import encode_shared, prepare_table
from storage.store import KeyGroupWrite

SPLITS, BATCH = 8, 8192  # the source's splits and batch size (the reference loops see the same batches)

# the targets (string keys)
PROCESS_P2_PROCESSING = 1_500_000
PROCESS_P2_END_TO_END = 1_000_000
PROCESS_P1_OF_DICT = 0.20
AGGREGATE_OF_GROUP_BY = 0.30
CHECKPOINT_SECONDS = {1_000_000: 0.3, 5_000_000: 1.2}
PEAK_PSS_MB = 140  # process, p=1: <= 1.3x Bytewax's peak with snapshots
DELTA_OF_FULL = 0.03  # a 1 % change of 100 k keys writes <= 3 % of a full snapshot (state files + manifest)
DELTA_FIXED_BYTES = 64  # ... <= 64 bytes of fixed cost per changed key group
DELTA_KEY_GROUPS = 128
DELTA_LAYOUTS = {"a stream per key group (format 5)": 0, "shared ranges (format 6+)": None}  # share_below; None: default


class Events:
    """The batch of global record indices ``idx``: ``key`` (``"k{i % keys}"`` or ``i % keys``),
    ``value`` (``i % 100``); a pure function of the indices, as a replayable source needs.

    String keys are taken from the ``keys`` strings made once per process (as a source reading
    stored strings hands them over), not formatted per batch: formatting costs ~60 ns a row,
    about twice pyarrow ``group_by``'s whole per-row cost, and the job would measure its
    source instead of its operators (``group_by`` is timed on the batches, not their making).
    Where the job runs, the strings are made when the source is unpickled (a worker does that
    before it reports ready), not at the first batch: inside the measured processing window
    they cost 4-6 ms at 100 k keys and 40-60 ms at 1 M."""

    def __init__(self, keys: int, key_type: str) -> None:
        self.keys = keys
        self.key_type = key_type
        self._names: pa.Array | None = None

    def __getstate__(self) -> dict:
        return {"keys": self.keys, "key_type": self.key_type}  # the strings are made again where it runs

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["keys"], state["key_type"])
        if self.key_type == "string":
            self._make_names()

    def _make_names(self) -> pa.Array:
        if self._names is None:
            self._names = pc.binary_join_element_wise("k", pa.array(np.arange(self.keys)).cast(pa.string()), "")
        return self._names

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        key = pa.array(idx % self.keys)
        if self.key_type == "string":
            key = self._make_names().take(key)
        return pa.RecordBatch.from_arrays([key, pa.array(idx % 100)], names=["key", "value"])


def running_sum(ctx, event):
    total = ctx.state.total
    total.update((total.value() or 0) + event["value"])


def build(path: str, events: int, keys: int, key_type: str, max_parallelism: int = 128) -> abs.Dataflow:
    flow = abs.Dataflow(f"reference-{path}", max_parallelism=max_parallelism)
    src = abs.GeneratorSource(events, num_keys=keys, num_splits=SPLITS, batch_size=BATCH,
                              make_batch=Events(keys, key_type))
    keyed = flow.source("events", src).key_by("key")
    if path == "process":
        keyed.process("sum", running_sum, state=[abs.ValueState("total", pa.int64())])
    else:
        keyed.aggregate("sum", {"total": ("value", "sum")}, emit="none")
    return flow


def source_batches(events: int, keys: int, key_type: str) -> list[pa.RecordBatch]:
    """The batches the job's source emits (split by split; the order does not change a sum)."""
    make = Events(keys, key_type)
    out = []
    for s in range(SPLITS):
        idx = np.arange(s, events, SPLITS, dtype=np.int64)
        out.extend(make(idx[at:at + BATCH]) for at in range(0, len(idx), BATCH))
    return out


def expected_sums(events: int, keys: int) -> np.ndarray:
    idx = np.arange(events, dtype=np.int64)
    return np.bincount(idx % keys, weights=idx % 100, minlength=keys).astype(np.int64)


def sums_match(keys_col: pa.ChunkedArray | pa.Array, values: pa.ChunkedArray | pa.Array, expected: np.ndarray) -> bool:
    """Whether (key, sum) rows hold exactly one row per key with its expected sum."""
    if pa.types.is_string(keys_col.type):
        keys_col = pc.utf8_slice_codeunits(keys_col, 1).cast(pa.int64())
    k = np.asarray(keys_col.to_numpy() if isinstance(keys_col, pa.ChunkedArray) else keys_col.to_numpy(zero_copy_only=False))
    v = np.asarray(values.to_numpy() if isinstance(values, pa.ChunkedArray) else values.to_numpy(zero_copy_only=False))
    if len(k) != len(expected):
        return False
    order = np.argsort(k)
    return bool(np.array_equal(k[order], np.arange(len(expected))) and np.array_equal(v[order], expected))


def state_matches(root: str, expected: np.ndarray) -> bool:
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.latest_checkpoint())
    tables = [store.read_key_group(manifest, "sum", "total", kg) for kg in manifest.keyed["sum"]["total"]]
    table = pa.concat_tables([t.select(["key", "value"]) for t in tables])
    return sums_match(table.column("key"), table.column("value"), expected)


@dataclass
class JobRun:
    end_to_end: float  # events/s, abs.run called to returned
    processing: float  # events/s, workers started to sources exhausted
    checkpoints: int
    last_checkpoint_s: float  # duration of the last (final) checkpoint
    verified: bool


def run_job(path: str, events: int, keys: int, key_type: str, parallelism: int, interval: float | None,
            expected: np.ndarray, root_dir: str | None) -> JobRun:
    root = tempfile.mkdtemp(prefix="abs-reference-", dir=root_dir)
    try:
        flow = build(path, events, keys, key_type)
        t0 = time.perf_counter()
        result = abs.run(flow, parallelism=parallelism, storage=root,
                         checkpoint=abs.CheckpointConfig(interval=interval, retained=2))
        elapsed = time.perf_counter() - t0
        cps = result.completed_checkpoints
        return JobRun(end_to_end=events / elapsed, processing=events / result.timings["processing_s"],
                      checkpoints=len(cps), last_checkpoint_s=cps[-1].duration if cps else float("nan"),
                      verified=state_matches(root, expected))
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- peak memory


def _pss_bytes(pid: int) -> int:
    """``Pss`` of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    """The children of every thread of ``pid`` (``/proc/<pid>/task/<tid>/children``)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def tree_pss(root: int) -> int:
    """Summed ``Pss`` of ``root`` and every process below it."""
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += _pss_bytes(pid)
        todo.extend(_children(pid))
    return total


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PFN_MASK = np.uint64((1 << 55) - 1)


def _frames(pid: int) -> np.ndarray | None:
    """The page frame numbers of every page of ``pid`` present in memory (``/proc/<pid>/pagemap``;
    empty once it is gone); None when the kernel hides them (they read as 0 without
    CAP_SYS_ADMIN)."""
    parts = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            ranges = [fields[0].split("-") for fields in map(str.split, f) if fields[1] != "---p"]  # guard pages: never present
        with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as pagemap:
            for lo, hi in ranges:
                start, end = int(lo, 16) // _PAGE, int(hi, 16) // _PAGE
                if start >= 1 << 40:  # [vsyscall]: pagemap has no entries for it
                    continue
                pagemap.seek(start * 8)
                entries = np.frombuffer(pagemap.read((end - start) * 8), dtype=np.uint64)
                present = entries[(entries >> np.uint64(63)).astype(bool)]
                if len(present):
                    parts.append(present & _PFN_MASK)
    except OSError:
        return np.empty(0, np.uint64)
    if not parts:
        return np.empty(0, np.uint64)
    frames = np.concatenate(parts)
    return None if not frames.any() else frames


def tree_distinct_bytes(root: int) -> int | None:
    """Bytes of the distinct physical pages that ``root`` and every process below it map,
    each page counted once however many of them map it (the peak PSS such a job would show
    on a machine where no other process maps its libraries); None when page frame numbers
    are hidden from this process (CAP_SYS_ADMIN)."""
    frames, todo = [], [root]
    while todo:
        pid = todo.pop()
        got = _frames(pid)
        if got is None:
            return None
        frames.append(got)
        todo.extend(_children(pid))
    return len(np.unique(np.concatenate(frames))) * _PAGE


def memory_unavailable() -> str | None:
    """Why peak PSS cannot be measured here, or None."""
    if not os.path.exists("/proc/self/smaps_rollup"):
        return "no /proc/<pid>/smaps_rollup here (Linux 4.14 or later)"
    if not os.path.exists(f"/proc/self/task/{os.getpid()}/children"):
        return "no /proc/<pid>/task/<tid>/children here (a kernel without CONFIG_PROC_CHILDREN)"
    return None


def peak_pss(events: int, keys: int, key_type: str, root_dir: str | None) -> tuple[float, float | None, bool]:
    """Peak summed PSS (bytes) of a ``process`` job at p=1 run alone in a fresh interpreter
    (``--memory-job``), sampled every 20 ms until its ``abs.run`` returned; the peak of its
    distinct pages (:func:`tree_distinct_bytes`, sampled every 0.2 s: reading the page tables
    costs tens of ms; None where page frame numbers are hidden); and whether its final sums
    were right."""
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-job", "--events", str(events), "--keys", str(keys),
           "--key-types", key_type] + (["--root", root_dir] if root_dir else [])
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    peak = 0
    distinct: list[int | None] = [0]
    ran = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not ran.wait(0.02):
            peak = max(peak, tree_pss(child.pid))

    def sample_distinct() -> None:
        while not ran.wait(0.2):
            got = tree_distinct_bytes(child.pid)
            if got is None:
                distinct[0] = None
                return
            distinct[0] = max(distinct[0], got)

    samplers = [threading.Thread(target=sample, daemon=True), threading.Thread(target=sample_distinct, daemon=True)]
    for sampler in samplers:
        sampler.start()
    assert child.stdout is not None
    lines = []
    for line in child.stdout:
        if line.startswith("ran"):
            ran.set()  # abs.run returned: what the child does next (the check) is not the job's
        lines.append(line)
    ran.set()
    for sampler in samplers:
        sampler.join()
    if child.wait() != 0:
        raise RuntimeError(f"the memory job ({' '.join(cmd)}) failed with exit code {child.returncode}")
    verdict_line = [json.loads(line) for line in lines if line.startswith("{")]
    return peak, distinct[0], bool(verdict_line and verdict_line[0]["verified"])


def memory_job(args: argparse.Namespace) -> int:
    """``--memory-job``: one ``process`` job at p=1 in this fresh interpreter; prints ``ran``
    when ``abs.run`` returned, then the check of its sums as JSON."""
    keys, key_type = args.keys[0], args.key_types[0]
    events = max(args.events, keys)
    root = tempfile.mkdtemp(prefix="abs-reference-memory-", dir=args.root)
    try:
        abs.run(build("process", events, keys, key_type), parallelism=1, storage=root,
                checkpoint=abs.CheckpointConfig(interval=1.0, retained=2))
        print("ran", flush=True)
        print(json.dumps({"verified": state_matches(root, expected_sums(events, keys))}), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def dict_loop_rate(batches: list[pa.RecordBatch]) -> float:
    keys: list = []
    values: list = []
    for b in batches:
        keys += b.column(0).to_pylist()
        values += b.column(1).to_pylist()
    t0 = time.perf_counter()
    sums: dict = {}
    get = sums.get
    for k, v in zip(keys, values):
        sums[k] = get(k, 0) + v
    return len(keys) / (time.perf_counter() - t0)


def group_by_rate(batches: list[pa.RecordBatch], expected: np.ndarray) -> tuple[float, bool]:
    table = pa.Table.from_batches(batches)
    table.slice(0, 1000).group_by("key", use_threads=False).aggregate([("value", "sum")])  # warm-up: first call set-up
    t0 = time.perf_counter()
    grouped = table.group_by("key", use_threads=False).aggregate([("value", "sum")])
    rate = table.num_rows / (time.perf_counter() - t0)
    return rate, sums_match(grouped.column("key"), grouped.column("value_sum"), expected)


# ----------------------------------------------------------------------------- printing


def k(x: float) -> str:
    """A rate in events/s, short: 812k, 1.52M."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.0f}k"


def spread(xs: list[float], fmt=k) -> str:
    """Median and range of the rounds' figures."""
    if len(xs) == 1:
        return fmt(xs[0])
    return f"{fmt(float(np.median(xs)))} ({fmt(min(xs))}..{fmt(max(xs))})"


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def secs(x: float) -> str:
    return f"{x:.2f} s"


def msecs(x: float) -> str:
    return f"{1000 * x:.1f} ms"


# Set by --quick: a smoke test's sizes are too small for its figures to say whether a target is
# met (fixed costs per batch and per job dominate), so no verdict is printed then.
SMOKE_TEST = False


def verdict(ok: bool) -> str:
    if SMOKE_TEST:
        return "not judged (--quick)"
    return "met" if ok else "NOT met"


# ----------------------------------------------------------------------------- experiments


def headline(args: argparse.Namespace, paths: list[str]) -> None:
    for keys in args.keys:
        events = max(args.events, keys)
        expected = expected_sums(events, keys)
        for key_type in args.key_types:
            batches = source_batches(events, keys, key_type)
            runs: dict[tuple[str, int], list[JobRun]] = {(p, par): [] for p in paths for par in args.parallelism}
            loops: list[float] = []
            groups: list[float] = []
            groups_ok = True
            memory: list[tuple[float, float | None, bool]] = []
            measure_memory = ("process" in paths and 1 in args.parallelism and key_type == "string"
                              and memory_unavailable() is None)
            for _ in range(args.rounds):
                if measure_memory:
                    memory.append(peak_pss(events, keys, key_type, args.root))
                if "process" in paths:
                    loops.append(dict_loop_rate(batches))
                if "aggregate" in paths:
                    rate, ok = group_by_rate(batches, expected)
                    groups.append(rate)
                    groups_ok &= ok
                for (path, par), got in runs.items():
                    got.append(run_job(path, events, keys, key_type, par, 1.0, expected, args.root))
            print(f"\n== {events:,} events, {keys:,} {key_type} keys, keyed running sum, checkpoints every 1 s; "
                  f"{args.rounds} round(s): median (min..max)", flush=True)
            if loops:
                print(f"  plain Python dict loop       {spread(loops)} events/s")
            if groups:
                print(f"  pyarrow group_by (1 thread)  {spread(groups)} events/s  sums verified: {'yes' if groups_ok else 'NO'}")
            for (path, par), got in runs.items():
                verified = sum(r.verified for r in got)
                print(f"  {path:<9} p={par}  processing {spread([r.processing for r in got])}  end-to-end "
                      f"{spread([r.end_to_end for r in got])} events/s  checkpoints {spread([r.checkpoints for r in got], str)}  "
                      f"sums verified: {'yes' if verified == len(got) else 'NO'} ({verified}/{len(got)})", flush=True)
                strings = key_type == "string"
                if path == "process" and par == 1:
                    share = [r.processing / loop for r, loop in zip(got, loops)]
                    print(f"      processing / dict loop {spread(share, pct)}"
                          + (f"   target >= {pct(PROCESS_P1_OF_DICT)}: {verdict(float(np.median(share)) >= PROCESS_P1_OF_DICT)}"
                             if strings else ""))
                if path == "process" and par == 1 and strings:
                    why = memory_unavailable()
                    if why is not None:
                        print(f"      peak PSS: not measured ({why})")
                    elif memory:
                        mb = [peak / 2**20 for peak, _, _ in memory]
                        ok = sum(v for _, _, v in memory)
                        print(f"      peak PSS (the job alone in a fresh interpreter: driver, worker, writer) "
                              f"{spread(mb, lambda x: f'{x:.0f} MB')}   target <= {PEAK_PSS_MB} MB: "
                              f"{verdict(float(np.median(mb)) <= PEAK_PSS_MB)}   sums verified: "
                              f"{'yes' if ok == len(memory) else 'NO'} ({ok}/{len(memory)})", flush=True)
                        if any(d is None for _, d, _ in memory):
                            print("      peak distinct pages: not measured (page frame numbers need CAP_SYS_ADMIN)")
                        else:
                            mb = [d / 2**20 for _, d, _ in memory]
                            print(f"      peak distinct pages (each page the job maps counted once: its PSS on an idle "
                                  f"machine) {spread(mb, lambda x: f'{x:.0f} MB')}   target <= {PEAK_PSS_MB} MB: "
                                  f"{verdict(float(np.median(mb)) <= PEAK_PSS_MB)}", flush=True)
                if path == "process" and par == 2 and strings:
                    proc = float(np.median([r.processing for r in got]))
                    e2e = float(np.median([r.end_to_end for r in got]))
                    print(f"      target processing >= {k(PROCESS_P2_PROCESSING)}: {verdict(proc >= PROCESS_P2_PROCESSING)}   "
                          f"target end-to-end >= {k(PROCESS_P2_END_TO_END)}: {verdict(e2e >= PROCESS_P2_END_TO_END)}")
                if path == "aggregate":
                    share = [r.processing / g for r, g in zip(got, groups)]
                    print(f"      processing / group_by  {spread(share, pct)}"
                          + (f"   target >= {pct(AGGREGATE_OF_GROUP_BY)}: "
                             f"{verdict(float(np.median(share)) >= AGGREGATE_OF_GROUP_BY)}" if strings else ""))


def checkpoint_cost(args: argparse.Namespace) -> None:
    """Section 3 of the module docstring: the final (full) checkpoint of K keys, aggregate vs process."""
    for keys in args.checkpoint_keys:
        expected = expected_sums(keys, keys)
        for key_type in args.key_types:
            runs: dict[str, list[JobRun]] = {"aggregate": [], "process": []}
            for _ in range(args.rounds):
                for path, got in runs.items():
                    got.append(run_job(path, keys, keys, key_type, 1, None, expected, args.root))
            agg = [r.last_checkpoint_s for r in runs["aggregate"]]
            proc = [r.last_checkpoint_s for r in runs["process"]]
            target = CHECKPOINT_SECONDS.get(keys)
            ok = all(r.verified for got in runs.values() for r in got)
            print(f"\n== a full checkpoint of {keys:,} {key_type} keys (every key changed; the final checkpoint of a "
                  f"job of {keys:,} events, p=1); {args.rounds} round(s): median (min..max)", flush=True)
            print(f"  checkpoint  aggregate {spread(agg, secs)}   process {spread(proc, secs)}   aggregate / process "
                  f"{spread([a / p for a, p in zip(agg, proc)], lambda x: f'{x:.2f}x')}   sums verified: {'yes' if ok else 'NO'}"
                  + (f"   target aggregate <= {secs(target)}: {verdict(float(np.median(agg)) <= target)}" if target else ""),
                  flush=True)


@dataclass
class DeltaRun:
    full_bytes: int
    delta_bytes: int
    full_manifest: int
    delta_manifest: int
    write_s: float  # the delta checkpoint's write_key_groups + commit
    read_s: float  # reading every key group of the delta checkpoint back (a fresh store)
    verified: bool
    commit_s: float  # the delta checkpoint's commit: its manifest encoded and written
    manifest_read_s: float  # its manifest read and parsed by a fresh store


class DeltaState:
    """K string keys in key groups, their values, and the 1 % of them that change."""

    def __init__(self, keys: int, seed: int = 23) -> None:
        self.key = pc.binary_join_element_wise("k", pa.array(np.arange(keys)).cast(pa.string()), "")
        rng = np.random.default_rng(seed)
        self.value = rng.integers(0, 2000, keys)  # running sums of ~20 events of 0..99 each, as the headline job's
        groups = key_groups(self.key, DELTA_KEY_GROUPS)
        order = np.argsort(groups, kind="stable")
        bounds = np.searchsorted(groups[order], np.arange(DELTA_KEY_GROUPS + 1))
        self.rows = {g: order[bounds[g]:bounds[g + 1]] for g in range(DELTA_KEY_GROUPS) if bounds[g + 1] > bounds[g]}
        changed = np.zeros(keys, bool)
        changed[rng.choice(keys, max(1, keys // 100), replace=False)] = True
        self.changed = {g: rows[changed[rows]] for g, rows in self.rows.items() if changed[rows].any()}
        meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow", b"abs.state_kind": b"value"}
        self.schema = pa.schema([("key", pa.string()), ("value", pa.int64())], metadata=meta)

    def table(self, rows: np.ndarray, bump: int = 0) -> pa.Table:
        return pa.table([self.key.take(rows), pa.array(self.value[rows] + bump)], schema=self.schema)

    def one_stream_bytes(self) -> int:
        """The changed rows of every key group encoded as one stream as a shared range is (the
        floor of the delta: what the rows cost without a cost per key group)."""
        return encode_shared([prepare_table(self.table(self.changed[g], 1), "delta") for g in sorted(self.changed)]).size


def run_deltas_once(state: DeltaState, share_below: int | None, root_dir: str | None) -> DeltaRun:
    root = tempfile.mkdtemp(prefix="abs-deltas-", dir=root_dir)
    try:
        store = SnapshotStore.open(root)
        if share_below is not None:
            store.share_below = share_below
        store.init_job({"job_name": "deltas", "max_parallelism": DELTA_KEY_GROUPS})
        groups = sorted(state.rows)
        chains = dict(zip(groups, store.write_key_groups(1, [
            KeyGroupWrite("sum", "total", g, [], state.table(state.rows[g]), complete=True) for g in groups])))
        m1 = store.commit(Manifest(checkpoint_id=1, job_name="deltas", max_parallelism=DELTA_KEY_GROUPS,
                                   keyed={"sum": {"total": dict(chains)}}))
        changed = sorted(state.changed)
        t0 = time.perf_counter()
        new = store.write_key_groups(2, [KeyGroupWrite("sum", "total", g, chains[g], state.table(state.changed[g], 1))
                                         for g in changed])
        chains.update(zip(changed, new))
        t1 = time.perf_counter()
        m2 = store.commit(Manifest(checkpoint_id=2, job_name="deltas", max_parallelism=DELTA_KEY_GROUPS,
                                   keyed={"sum": {"total": dict(chains)}}))
        write_s, commit_s = time.perf_counter() - t0, time.perf_counter() - t1
        files = store.list_files()
        fresh = SnapshotStore.open(root)
        t0 = time.perf_counter()
        manifest = fresh.read_manifest(2)
        manifest_read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        tables = [fresh.read_key_group(manifest, "sum", "total", g) for g in groups]
        read_s = time.perf_counter() - t0
        got = pa.concat_tables(tables).sort_by("key")
        bumped = state.value.copy()
        for rows in state.changed.values():
            bumped[rows] += 1
        want = pa.table([state.key, pa.array(bumped)], names=["key", "value"]).sort_by("key")
        verified = got.column("key").equals(want.column("key")) and got.column("value").equals(want.column("value"))
        return DeltaRun(full_bytes=m1.stats["bytes_written"], delta_bytes=m2.stats["bytes_written"],
                        full_manifest=files["checkpoints/chk-00000001.json"],
                        delta_manifest=files["checkpoints/chk-00000002.json"],
                        write_s=write_s, read_s=read_s, verified=verified, commit_s=commit_s,
                        manifest_read_s=manifest_read_s)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def deltas(args: argparse.Namespace) -> None:
    """Section 4 of the module docstring."""
    for keys in args.delta_keys:
        state = DeltaState(keys)
        floor = state.one_stream_bytes()
        runs: dict[str, list[DeltaRun]] = {name: [] for name in DELTA_LAYOUTS}
        for _ in range(args.rounds):
            for name, share_below in DELTA_LAYOUTS.items():
                runs[name].append(run_deltas_once(state, share_below, args.root))
        n_changed = len(state.changed)
        print(f"\n== deltas: 1 % of {keys:,} string keys changed ({max(1, keys // 100):,} rows in {n_changed} of "
              f"{len(state.rows)} key groups); {args.rounds} round(s): median (min..max); the changed rows as one "
              f"stream: {floor:,} B", flush=True)
        for name, got in runs.items():
            r = got[0]  # the sizes do not vary between rounds (same data, deterministic encoding)
            ratio = r.delta_bytes / r.full_bytes
            fixed = (r.delta_bytes - floor) / n_changed
            target = keys == 100_000
            ok = all(x.verified for x in got)
            full_all, delta_all = r.full_bytes + r.full_manifest, r.delta_bytes + r.delta_manifest
            print(f"  {name:<36} state files: full {r.full_bytes:>11,} B  delta {r.delta_bytes:>10,} B  delta / full "
                  f"{pct(ratio)}")
            print(f"  {'':<36} with the manifests: full {full_all:>11,} B  delta {delta_all:>10,} B  delta / full "
                  f"{pct(delta_all / full_all)}"
                  + (f" (target <= {pct(DELTA_OF_FULL)}: {verdict(delta_all / full_all <= DELTA_OF_FULL)})" if target else "")
                  + f"   manifests: full {r.full_manifest:,} B, delta {r.delta_manifest:,} B")
            print(f"  {'':<36} fixed cost per changed key group {fixed:,.0f} B"
                  + (f" (target <= {DELTA_FIXED_BYTES}: {verdict(fixed <= DELTA_FIXED_BYTES)})" if target else "")
                  + f"   delta manifest: commit {spread([x.commit_s for x in got], msecs)}, read "
                  f"{spread([x.manifest_read_s for x in got], msecs)}")
            print(f"  {'':<36} delta write {spread([x.write_s for x in got], secs)}   read back every key group "
                  f"{spread([x.read_s for x in got], secs)}   state verified: {'yes' if ok else 'NO'} "
                  f"({sum(x.verified for x in got)}/{len(got)})", flush=True)


def load() -> str:
    try:
        return " ".join(f"{x:.1f}" for x in os.getloadavg())
    except OSError:
        return "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 100,000 events over 10,000 keys, one round, parallelism 1; checkpoints of 20,000 keys")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each running every configuration once (default 3)")
    ap.add_argument("--events", type=int, default=2_000_000, help="events per job (default 2,000,000; at least --keys)")
    ap.add_argument("--keys", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000], metavar="K",
                    help="distinct keys, one table each (default: 100000 1000000 5000000)")
    ap.add_argument("--key-types", nargs="+", choices=("string", "int"), default=["string", "int"])
    ap.add_argument("--parallelism", type=int, nargs="+", default=[1, 2], metavar="P")
    ap.add_argument("--checkpoint-keys", type=int, nargs="+", default=[1_000_000, 5_000_000], metavar="K",
                    help="state sizes of the checkpoint-cost rows (default: 1000000 5000000)")
    ap.add_argument("--only", nargs="+", choices=("process", "aggregate", "checkpoint"),
                    default=["process", "aggregate", "checkpoint"])
    ap.add_argument("--root", default=None, metavar="DIR", help="directory for the jobs' storage roots")
    ap.add_argument("--deltas", action="store_true",
                    help="only section 4: the bytes of a 1 %% delta against a full checkpoint, format 5 and 6 layouts")
    ap.add_argument("--delta-keys", type=int, nargs="+", default=[100_000, 1_000_000, 5_000_000], metavar="K",
                    help="state sizes of --deltas (default: 100000 1000000 5000000)")
    ap.add_argument("--memory-job", action="store_true", help=argparse.SUPPRESS)  # peak_pss's child
    args = ap.parse_args()
    if args.memory_job:
        return memory_job(args)
    if args.quick:
        global SMOKE_TEST
        SMOKE_TEST = True
        args.events, args.keys, args.rounds, args.parallelism = 100_000, [10_000], 1, [1]
        args.checkpoint_keys, args.delta_keys = [20_000], [20_000]
    if args.rounds < 1 or args.events < 1 or min(args.keys) < 1 or min(args.parallelism) < 1:
        ap.error("--rounds, --events, --keys and --parallelism must be positive")
    print(f"load average at the start {load()} ({os.cpu_count()} cores): figures on a loaded machine say little", flush=True)
    if args.deltas:
        deltas(args)
        print(f"\nload average at the end {load()}")
        return 0
    paths = [p for p in args.only if p != "checkpoint"]
    if paths:
        headline(args, paths)
    if "checkpoint" in args.only:
        checkpoint_cost(args)
    print(f"\nload average at the end {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
