"""Restore and rescale benchmark (ratios measured in one run; the machine is shared and noisy).

1. A job puts 1,000,000 keys with ~100-byte values (about 100 MB in memory) into keyed
   state at parallelism 4 and ends with a complete checkpoint on local disk.
2. The same job is restored from it at parallelism 4, 2 (rescale 4 -> 2), back to 4 from a
   checkpoint taken at 2 (rescale 2 -> 4), and into one worker (rescale 4 -> 1). For each:
   time from `abs.run` until every worker has restored its state and the sources start
   (time to first record), restore throughput per worker and of all workers together in
   MB/s, and bytes read per worker against its share (target: at most 1.1 x the share).
   Plain pyarrow reads the same files and ranges in one process, *warm* (this process, each
   table dropped at once: its buffers serve the next read) and *cold* (a fresh process
   keeping every table, as a restore keeps its state). Several workers share the machine's
   cores, so only the one-worker restore is held against pyarrow's cold read (target >= 0.5,
   as ``--reference`` holds the reference state).

``--state sums`` puts the reference workload's state instead: string keys ``"k<i>"`` with an
int64 running sum each (the issue's target: the first record <= 0.6 s after restoring 5 M
keys, and restore >= 0.5 x pyarrow's read speed).

``--reference`` measures issue 23's target 6 on the reference workload's state (``--state
sums``: string keys, an int64 sum each), for ``process`` (a ``ValueState``) and ``aggregate``,
at each of ``--reference-keys`` (default 1 M and 5 M). One job per configuration writes the
state at parallelism 1 (one checkpoint); then every round restores that very checkpoint in
each configuration, the configurations interleaved:

- *pyarrow*: plain pyarrow reading every file and range of the checkpoint (MB/s), twice: in
  this process, which has read them before, each table dropped as soon as it is read (*warm*:
  its memory pool hands the buffers of the range before back for the next; the files are in
  the page cache), and in a fresh process that keeps every table it read, as a restore keeps
  the state it read (*cold*: every buffer is new memory, whose pages the kernel faults in:
  ~0.4 s a GB on the development machine);
- *in-process*: a fresh process (spawned, transparent huge pages off as in a worker) restores
  every key group into the operator's backend as a worker does (``read_chain`` then
  ``restore``), MB/s against both pyarrow figures (target >= 0.5), then
  uses every key group once as a record does (``process``: the handle's ``value()`` of one of
  its keys, which probes its text or int keys, or builds the Python objects of its keys and its key
  index where it cannot: deferred to a key group's first use, :mod:`abs.state.restored`), or
  for ``aggregate`` indexes the keys its columnar store restored in bulk; "with index" counts
  both, and the resident memory the restore and the first uses added (MB); ``process`` then
  times a read-modify-write of every 5th key (us a record; the first write to a probed key
  group copies its values and makes its stamps, counted here) and the memory after them, then
  the deletes of every 100th key (1 %, ``clear()`` as a record does: a probed key group marks
  their slots dead and stays probed; the seconds for all of them, the memory they added, and
  how many key groups were probed before and after), and does all of it again with every key
  group built before its first use ("built index": a restore without the C module), in
  another fresh process; the restored sums are checked;
  ``--paths aggregate-int`` adds the aggregate over int keys, ``process-int`` the process
  function over int keys;
- *job*: ``abs.run`` at parallelism 1 restoring the checkpoint with 10,000 more events: the
  worker's restore MB/s against pyarrow's, the time to the sources' start, and for ``process``
  the time from ``abs.run`` to the end of the first record's call (written by the function
  itself; target <= 0.6 s at 5 M keys); the same job without state (a fresh start on the
  10,000 events) gives the baselines.

Printed: medians and ranges (min..max) over the rounds.

    .venv/bin/python scripts/bench_recovery.py [--keys N] [--state payload|sums]
    .venv/bin/python scripts/bench_recovery.py --reference [--reference-keys K [K ...]] [--rounds N]
        [--paths process aggregate aggregate-int process-int]
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

import abs
from abs.keygroups import key_group_range
from abs.runtime.operators import read_ahead
from abs.runtime.worker import RESTORE_READERS
from abs.runtime.worker_main import no_huge_pages
from abs.state.aggregate_backend import AggregateBackend
from abs.state.dict_backend import KeyedStateBackend
from abs.state.restored import RestoredColumn
from storage import SnapshotStore


RATIO_TARGET = 0.5  # restore speed against plain pyarrow reading the same files and ranges
FIRST_RECORD_TARGET = 0.6  # seconds from abs.run to the first record after restoring 5 M keys
EXTRA_EVENTS = 10_000  # events after the checkpoint in a reference restore job
FIRST_RECORD_FILE = "ABS_BENCH_FIRST_RECORD"  # environment: where the first record's time goes


class Payloads:
    """Record i: key = i, payload = a ~100-byte string derived from i (replayable)."""

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        payload = [f'{{"id": {i}, "name": "user-{i % 9973}", "score": {i * 7919 % 100000}, "tags": ["a", "b"]}}' for i in idx.tolist()]
        return pa.RecordBatch.from_arrays([pa.array(idx), pa.array(payload)], names=["key", "payload"])


class Sums:
    """Record i: key = "k<i>" (``ints``: i), value = i % 100 (the reference workload's events)."""

    def __init__(self, ints: bool = False) -> None:
        self.ints = ints

    def __call__(self, idx: np.ndarray) -> pa.RecordBatch:
        keys = pa.array(idx) if self.ints else pa.array([f"k{i}" for i in idx.tolist()])
        return pa.RecordBatch.from_arrays([keys, pa.array(idx % 100)], names=["key", "value"])


def keep_latest(ctx, row):
    ctx.state.last.update(row["payload"])


def running_sum(ctx, row):
    total = ctx.state.total
    total.update((total.value() or 0) + row["value"])


def running_sum_marked(ctx, row):
    """running_sum that writes the wall-clock time its first call ends to the file named by
    the environment (the reference restore job's first record)."""
    running_sum(ctx, row)
    global _marked
    if not _marked:
        _marked = True
        path = os.environ.get(FIRST_RECORD_FILE)
        if path:
            with open(path, "w") as f:
                f.write(repr(time.time()))


_marked = False


def build(keys: int, count: int | None = None, state: str = "payload") -> abs.Dataflow:
    flow = abs.Dataflow("bench-restore")
    src = abs.GeneratorSource(keys if count is None else count, num_keys=keys, num_splits=8, batch_size=8192,
                              make_batch=Payloads() if state == "payload" else Sums())
    if state == "payload":
        flow.source("events", src).key_by("key").process("latest", keep_latest, state=[abs.ValueState("last", pa.string())])
    else:
        flow.source("events", src).key_by("key").process("sum", running_sum, state=[abs.ValueState("total", pa.int64())])
    return flow


def pyarrow_read_speed(root: str, checkpoint_id: int | None = None, keep: bool = False) -> tuple[float, int, int]:
    """MB/s of plain pyarrow reading every state file and range of the latest checkpoint (one
    process), the bytes a full restore reads (each file, or each key group's range of a packed
    file, once) and the bytes of the distinct files on disk.

    A range of a packed file is a complete IPC stream (one key group's, or in format 6 a
    shared range of several key groups' rows): it is read on its own, once, as a restore reads
    it; the whole packed file is not one stream (reading it as one would stop after its first
    range). ``keep``: every table read is kept until the end (as a restore keeps what it read),
    instead of being dropped at once (its buffers then serve the next range's read)."""
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(store.latest_checkpoint() if checkpoint_id is None else checkpoint_id)
    by_path: dict[str, list] = {}
    for ref in {ref.range_id: ref for ref in manifest.files().values()}.values():  # a shared range once
        by_path.setdefault(ref.path, []).append(ref)
    total = sum(ref.read_size for refs in by_path.values() for ref in refs)
    on_disk = sum(os.path.getsize(os.path.join(root, path)) for path in by_path)
    rows = 0
    kept: list = []
    t0 = time.perf_counter()
    for path, refs in by_path.items():
        with pa.memory_map(os.path.join(root, path)) as f:
            data = f.read_buffer()
            for ref in refs:
                part = data if ref.offset is None else data.slice(ref.offset, ref.read_size)
                if part.size >= 6 and part[:6].to_pybytes() == b"ARROW1":  # format 1: IPC file
                    table = pa.ipc.open_file(part).read_all()
                else:  # format 2 and later: IPC stream
                    table = pa.ipc.open_stream(part).read_all()
                rows += table.num_rows
                if keep:
                    kept.append(table)
                del table
    seconds = time.perf_counter() - t0
    del kept
    expected = sum(ref.rows if ref.range_rows is None else ref.range_rows for refs in by_path.values() for ref in refs)
    if rows != expected:
        raise RuntimeError(f"pyarrow read {rows} rows, the manifest lists {expected}; the benchmark reads the files wrongly")
    return total / seconds / 1e6, total, on_disk


def _cold_read(root: str, checkpoint_id: int) -> float:
    no_huge_pages()  # as in a worker (and the in-process restore)
    return pyarrow_read_speed(root, checkpoint_id, keep=True)[0]


def pyarrow_cold_read_speed(root: str, checkpoint_id: int) -> float:
    """:func:`pyarrow_read_speed` in a fresh process that reads the files once and keeps every
    table it read until the end, as a restoring worker reads and keeps its state (MB/s): no
    buffer of an earlier read, nor of the range before, to reuse."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_cold_read, root, checkpoint_id).result()


def build_reference(path: str, keys: int, count: int) -> abs.Dataflow:
    """The reference workload's keyed running sum over ``count`` events of ``keys`` string keys
    (``aggregate-int``, ``process-int``: over int keys)."""
    flow = abs.Dataflow(f"bench-restore-{path}")
    src = abs.GeneratorSource(count, num_keys=keys, num_splits=8, batch_size=8192,
                              make_batch=Sums(ints=path.endswith("-int")))
    keyed = flow.source("events", src).key_by("key")
    if path.startswith("process"):
        keyed.process("sum", running_sum_marked, state=[abs.ValueState("total", pa.int64())])
    else:
        keyed.aggregate("sum", {"total": ("value", "sum")}, emit="none")
    return flow


@dataclass
class InProcess:
    """What :func:`restore_in_process` measured (the read-modify-writes and the deletes:
    ``process`` only, else NaN and 0)."""

    restore_s: float  # reading and restoring every key group
    first_use_s: float  # making every key group usable after that (aggregate: its index)
    nbytes: int  # bytes read
    grown_mb: float  # resident memory the restore and the first uses added
    rmw_s: float  # per read-modify-write of a restored key, after the first uses
    after_writes_mb: float  # resident memory added by then
    deletes_s: float  # deleting 1 % of the keys, after the read-modify-writes
    deletes_mb: float  # resident memory the deletes added
    probed_before: int  # key groups probed (not built) before the deletes
    probed_after: int  # and after them


def restore_in_process(flow: abs.Dataflow, root: str, checkpoint_id: int, keys: int,
                       built: bool = False) -> InProcess:
    """Restore every key group of ``checkpoint_id`` into the operator's backend in this process,
    as a worker of parallelism 1 does (reading ahead as it does), make every key group usable,
    then (``process``) read-modify-write every 5th key and delete every 100th; checks the keys
    and sums restored. ``built``
    (``process``): each key group builds its Python index before its first use instead of
    being probed (what a restore without the C module does)."""
    rss0 = rss_mb()
    store = SnapshotStore.open(root)
    manifest = store.read_manifest(checkpoint_id)
    node = next(n for n in flow.nodes if n.kind in ("process", "aggregate"))
    backend = KeyedStateBackend(node.uid, node.spec["state"], flow.max_parallelism,
                                key_group_range(flow.max_parallelism, 1, 0))
    target = AggregateBackend(backend, {"total": 0}) if node.kind == "aggregate" else backend
    items = [(state, kg, chain) for state in manifest.keyed[node.uid]
             for kg, chain in manifest.chains(node.uid, state).items()]
    nbytes = 0
    t0 = time.perf_counter()
    for (state, kg, chain), table in read_ahead(store.read_chain, items, RESTORE_READERS):
        nbytes += sum(ref.bytes for ref in chain)
        target.restore(state, kg, table)
    t1 = time.perf_counter()
    if node.kind == "aggregate" and target.columnar is not None:
        # the aggregate's columnar store indexes the string keys it restored in bulk after the
        # last key group (a worker's restore does it too: its figure includes it)
        target.finish_restore()
        t2 = time.perf_counter()
        grown = rss_mb() - rss0
        rows = list(target.items("total"))
        rmw = after = dels = deleted = float("nan")
        probed = still = 0
    else:
        # a restored key group is made usable on its first use (abs.state.restored): here
        # a record's read of one of its keys through the state's handle, as running_sum does
        data = backend._slot("total").data
        firsts = {kg: data[kg].image[0][0].item() if isinstance(data[kg].image[0], np.ndarray)
                  else data[kg].image[0][0].as_py() for kg in backend.key_group_range
                  if isinstance(data[kg].image, tuple) and len(data[kg])}  # restored, waiting
        handle = backend.state("total")
        t1b = time.perf_counter()
        for kg, key in firsts.items():
            if built:
                data[kg].build()
            backend.current_key, backend.current_kg = key, kg
            handle.value()
        t2 = t1 + time.perf_counter() - t1b  # the first uses alone
        grown = rss_mb() - rss0
        ints = isinstance(next(iter(firsts.values())), int)
        rmw = read_modify_writes(backend, handle, keys, flow.max_parallelism, ints)
        after = rss_mb() - rss0  # with what the first writes add (a probed key group's values and stamps)
        probed = sum(type(data[kg]) is RestoredColumn for kg in firsts)
        dels = deletes(backend, handle, keys, flow.max_parallelism, ints)
        deleted = rss_mb() - rss0 - after
        still = sum(type(data[kg]) is RestoredColumn for kg in firsts)
        rows = list(backend.items("total"))
    found = len(rows)
    total = sum(v for _k, v in rows)
    expected = (keys // 100) * 4950 + sum(range(keys % 100))
    want = keys
    if rmw == rmw:  # every 5th key got +1, then every 100th key (0 + 1 each) was deleted
        expected += len(range(0, keys, 5)) - len(range(0, keys, 100))
        want -= len(range(0, keys, 100))
    if found != want or total != expected:
        raise RuntimeError(f"restored {found} keys summing to {total}; expected {want} keys summing to {expected}")
    return InProcess(restore_s=t1 - t0, first_use_s=t2 - t1, nbytes=nbytes, grown_mb=grown, rmw_s=rmw,
                     after_writes_mb=after, deletes_s=dels, deletes_mb=deleted, probed_before=probed,
                     probed_after=still)


def deletes(backend: KeyedStateBackend, handle, keys: int, max_parallelism: int, ints: bool) -> float:
    """Seconds to delete every 100th restored key (1 % of them, ``handle.clear()``, as a
    record does) in key order, the key groups computed before."""
    names, kgs = every_nth_key(keys, 100, max_parallelism, ints)
    t0 = time.perf_counter()
    for key, kg in zip(names, kgs):
        backend.current_key = key
        backend.current_kg = kg
        handle.clear()
    return time.perf_counter() - t0


def every_nth_key(keys: int, step: int, max_parallelism: int, ints: bool) -> tuple[list, list]:
    """Every ``step``-th of the reference state's keys (``ints``: int keys, else ``"k<i>"``)
    in key order, and their key groups."""
    from abs.keygroups import key_groups

    names = list(range(0, keys, step)) if ints else [f"k{i}" for i in range(0, keys, step)]
    return names, key_groups(pa.array(names), max_parallelism).tolist()


def rss_mb() -> float:
    """This process's resident memory in MB (Linux; NaN elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration, ValueError):
        return float("nan")


def read_modify_writes(backend: KeyedStateBackend, handle, keys: int, max_parallelism: int, ints: bool) -> float:
    """Seconds per read-modify-write (+1) of every 5th restored key (``ints``: int keys, else
    ``"k<i>"``) through the state's handle,
    in key order (key groups interleaved, as records come), the key groups computed before."""
    names, kgs = every_nth_key(keys, 5, max_parallelism, ints)
    t0 = time.perf_counter()
    for key, kg in zip(names, kgs):
        backend.current_key = key
        backend.current_kg = kg
        handle.update(handle.value() + 1)
    return (time.perf_counter() - t0) / len(names)


def restore_reference(path: str, keys: int, root: str, checkpoint_id: int,
                      built: bool = False) -> InProcess:
    # in a child of this process: memory as a worker has it (transparent huge pages off, which
    # a worker turns off for Arrow's allocator; with them on, the first fault of a few hundred
    # MB of index may wait 0.5 s for the kernel to find huge pages, or take a fifth of that)
    no_huge_pages()
    return restore_in_process(build_reference(path, keys, keys), root, checkpoint_id, keys, built)


def reference_round(path: str, keys: int, root: str, checkpoint_id: int, scratch: str) -> dict:
    """One round of one configuration (see the module docstring): its figures by name."""
    out: dict = {}
    raw_mbs, total, _ = pyarrow_read_speed(root, checkpoint_id)
    out["pyarrow MB/s"] = raw_mbs
    cold_mbs = pyarrow_cold_read_speed(root, checkpoint_id)
    out["pyarrow cold MB/s"] = cold_mbs
    # in a fresh process, as a worker restores: not a fork of this one, whose heap and Arrow
    # pool (the warm reads' buffers) a fork would inherit
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        got = pool.submit(restore_reference, path, keys, root, checkpoint_id).result()
    secs, total_s = got.restore_s, got.restore_s + got.first_use_s
    out["in-process restore MB/s"] = got.nbytes / secs / 1e6
    out["in-process / pyarrow"] = got.nbytes / secs / 1e6 / raw_mbs
    out["in-process with index / pyarrow"] = got.nbytes / total_s / 1e6 / raw_mbs
    out["in-process with index / pyarrow cold"] = got.nbytes / total_s / 1e6 / cold_mbs
    out["memory after restore and first use (MB)"] = got.grown_mb
    if path.startswith("process"):
        # the same with each key group's Python index built (no C module), in another fresh process
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            b = pool.submit(restore_reference, path, keys, root, checkpoint_id, True).result()
        out["built index: with index / pyarrow cold"] = b.nbytes / (b.restore_s + b.first_use_s) / 1e6 / cold_mbs
        out["first use of every key group (s)"] = got.first_use_s
        out["built index: first use (s)"] = b.first_use_s
        out["read-modify-write of a restored key (us)"] = got.rmw_s * 1e6
        out["built index: read-modify-write (us)"] = b.rmw_s * 1e6
        out["built index: memory (MB)"] = b.grown_mb
        out["memory after the writes (MB)"] = got.after_writes_mb
        out["built index: memory after the writes (MB)"] = b.after_writes_mb
        out["delete 1 % of the keys (s)"] = got.deletes_s
        out["built index: delete 1 % (s)"] = b.deletes_s
        out["memory the deletes added (MB)"] = got.deletes_mb
        out["key groups probed before the deletes"] = got.probed_before
        out["key groups probed after the deletes"] = got.probed_after
    mark = os.path.join(scratch, "first-record")
    if os.path.exists(mark):
        os.remove(mark)
    os.environ[FIRST_RECORD_FILE] = mark
    t0 = time.time()
    result = abs.run(build_reference(path, keys, keys + EXTRA_EVENTS), parallelism=1, restore=checkpoint_id,
                     storage=root, checkpoint=abs.CheckpointConfig(retained=1000))
    per, rsecs = result.bytes_restored_per_worker, result.restore_seconds_per_worker
    out["job restore / pyarrow"] = per[0] / rsecs[0] / 1e6 / raw_mbs if rsecs and rsecs[0] > 0 else float("nan")
    out["job restore / pyarrow cold"] = per[0] / rsecs[0] / 1e6 / cold_mbs if rsecs and rsecs[0] > 0 else float("nan")
    out["job: sources start (s)"] = result.timings["startup_s"]
    if path.startswith("process"):
        with open(mark) as f:
            out["job: first record (s)"] = float(f.read()) - t0
    if os.path.exists(mark):
        os.remove(mark)
    t0 = time.time()
    cold = abs.run(build_reference(path, keys, EXTRA_EVENTS), parallelism=1)
    out["no state: sources start (s)"] = cold.timings["startup_s"]
    if path.startswith("process"):
        with open(mark) as f:
            out["no state: first record (s)"] = float(f.read()) - t0
    return out


def reference(keys_list: list[int], rounds: int, paths: list[str]) -> None:
    """Issue 23 target 6 (see the module docstring)."""
    configs = [(path, keys) for keys in keys_list for path in paths]
    scratch = tempfile.mkdtemp(prefix="abs-bench-restore-")
    roots: dict = {}
    try:
        for path, keys in configs:
            root = os.path.join(scratch, f"{path}-{keys}")
            t0 = time.perf_counter()
            first = abs.run(build_reference(path, keys, keys), parallelism=1, storage=root,
                            checkpoint=abs.CheckpointConfig(retained=1000))
            _, total, _ = pyarrow_read_speed(root, first.last_checkpoint)
            roots[path, keys] = (root, first.last_checkpoint)
            print(f"{path}, {keys:,} keys: written in {time.perf_counter() - t0:.1f} s, checkpoint "
                  f"{first.last_checkpoint}: {total / 1e6:.1f} MB to restore", flush=True)
        figures: dict = {c: {} for c in configs}
        for r in range(rounds):
            for c in configs:
                for name, value in reference_round(*c, *roots[c], scratch).items():
                    figures[c].setdefault(name, []).append(value)
            print(f"round {r + 1}/{rounds} done", flush=True)
        for (path, keys), by_name in figures.items():
            kind = "int" if path.endswith("-int") else "string"
            print(f"{path}, {keys:,} {kind} keys (medians, range over {rounds} rounds):")
            for name, values in by_name.items():
                target = ""
                if "/ pyarrow" in name and "in-process /" not in name:
                    target = f"  target >= {RATIO_TARGET}: {'met' if np.median(values) >= RATIO_TARGET else 'NOT met'}"
                elif name == "job: first record (s)":
                    target = (f"  target <= {FIRST_RECORD_TARGET} at 5 M keys: "
                              f"{'met' if np.median(values) <= FIRST_RECORD_TARGET else 'NOT met'}")
                print(f"  {name:<34} {np.median(values):8.3f}  ({min(values):.3f}..{max(values):.3f}){target}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def restore(flow: abs.Dataflow, root: str, parallelism: int) -> abs.JobResult:
    return abs.run(flow, parallelism=parallelism, restore="latest", storage=root, checkpoint=abs.CheckpointConfig())


def report(label: str, result: abs.JobResult, total_bytes: int, cold_mbs: float | None = None) -> None:
    """One restore's row; ``cold_mbs`` (a one-worker restore): its rate against pyarrow's cold
    read of the same checkpoint, with the target."""
    P = result.parallelism
    share = total_bytes / P
    per = result.bytes_restored_per_worker
    secs = result.restore_seconds_per_worker
    rates = [b / s / 1e6 for b, s in zip(per, secs) if s > 0]
    worst = max(per) / share
    together = sum(per) / max(secs) / 1e6 if secs and max(secs) > 0 else float("nan")
    against = ""
    if cold_mbs is not None:
        ratio = np.mean(rates) / cold_mbs
        against = (f" against pyarrow's cold read {cold_mbs:6.1f} MB/s: {ratio:4.2f} "
                   f"(target >= {RATIO_TARGET}: {'met' if ratio >= RATIO_TARGET else 'NOT met'});")
    print(f"  {label:<16} time to first record {result.timings['startup_s']:5.2f} s; "
          f"restore per worker {np.mean(rates):6.1f} MB/s;{against} all {P} workers together "
          f"{together:6.1f} MB/s on {os.cpu_count()} CPUs; "
          f"bytes read per worker / share: max {worst:4.2f}, mean {np.mean(per) / share:4.2f} "
          f"(target <= 1.1: {'met' if worst <= 1.1 else 'NOT met'})", flush=True)


def pyarrow_line(root: str, checkpoint_id: int) -> tuple[int, float]:
    """Prints pyarrow's warm and cold reads of a checkpoint; returns its bytes and the cold MB/s."""
    warm, total, _ = pyarrow_read_speed(root, checkpoint_id)
    cold = pyarrow_cold_read_speed(root, checkpoint_id)
    print(f"  pyarrow reading checkpoint {checkpoint_id} ({total / 1e6:.1f} MB) in one process: warm {warm:6.1f} MB/s, "
          f"cold {cold:6.1f} MB/s", flush=True)
    return total, cold


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--state", choices=["payload", "sums"], default="payload",
                    help="~100-byte string values under int keys, or int64 sums under string keys")
    ap.add_argument("--reference", action="store_true", help="issue 23 target 6 (see above)")
    ap.add_argument("--reference-keys", type=int, nargs="+", default=[1_000_000, 5_000_000])
    ap.add_argument("--rounds", type=int, default=3, help="--reference: rounds")
    ap.add_argument("--paths", nargs="+", choices=["process", "aggregate", "aggregate-int", "process-int"],
                    default=["process", "aggregate"], help="--reference: the configurations (-int: int keys)")
    args = ap.parse_args()
    if args.reference:
        reference(args.reference_keys, args.rounds, args.paths)
        return 0
    root = tempfile.mkdtemp(prefix="abs-bench-restore-")
    try:
        flow = build(args.keys, state=args.state)
        t0 = time.perf_counter()
        first = abs.run(flow, parallelism=4, storage=root, checkpoint=abs.CheckpointConfig(retained=10))
        _warm, total, on_disk = pyarrow_read_speed(root)
        print(f"state: {args.keys:,} keys written at parallelism 4 in {time.perf_counter() - t0:.1f} s; "
              f"checkpoint {first.last_checkpoint}: {total / 1e6:.1f} MB to restore ({on_disk / 1e6:.1f} MB of files "
              f"on disk, older checkpoints' ranges included)")
        pyarrow_line(root, first.last_checkpoint)
        cold = abs.run(build(args.keys, count=0, state=args.state), parallelism=4)
        print(f"  baseline: start-up without restore {cold.timings['startup_s']:.2f} s")
        r4 = restore(flow, root, 4)
        report("restore 4 -> 4", r4, total)
        total = pyarrow_read_speed(root, r4.last_checkpoint)[1]  # the checkpoint r4 ended with, at parallelism 4
        r2 = restore(flow, root, 2)
        report("rescale 4 -> 2", r2, total)
        total, _ = pyarrow_line(root, r2.last_checkpoint)
        r4 = restore(flow, root, 4)
        report("rescale 2 -> 4", r4, total)
        total, cold_mbs = pyarrow_line(root, r4.last_checkpoint)
        report("rescale 4 -> 1", restore(flow, root, 1), total, cold_mbs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
