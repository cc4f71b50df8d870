#!/usr/bin/env python
"""Storage benchmark: full snapshot, 1 % incremental checkpoint, chain read-back.

    .venv/bin/python scripts/bench_storage.py [--keys 1000000] [--root DIR] [--key-groups 128]
                                              [--shuffle] [--anatomy]

Measures, in one run on local disk (warm page cache for both readers):

1. a full snapshot of N int64 keys with ~100-byte JSON-like values in K key groups
   (bytes, time, compression against the in-memory Arrow size);
2. a checkpoint after changing 1 % of the keys (spread over all key groups): bytes written
   against the target 1.2 x 1 % of the full snapshot + a fixed cost per changed key group.
   The fixed cost is, strictly, the size of the delta file the store writes for a zero-row
   table of this schema (schema message + end-of-stream marker: what every delta file of the
   state carries however few rows it has, without the record batch that rows need). For
   comparison the run also prints the target with two looser fixed costs: that file plus one
   zero-row record batch, and the size-vs-rows intercept of real delta files;
3. reading every key group's chain back: MB/s and rows/s through ``SnapshotStore.read_chain``
   (checksums + resolve) next to plain ``pyarrow.ipc`` reading the same files (three ways:
   ``pa.OSFile``, ``pa.memory_map``, the whole file read then decoded; the fastest of them in
   each round is the baseline), and where the read_chain time goes (fetch, checksum, decode,
   resolve; measured separately).

``--shuffle`` hands every key group's rows to the store in random order, as a runtime's hash
map would (the default hands them sorted by key). ``--anatomy`` prints where the bytes of the
delta files go (stream framing, schema, record-batch headers, each buffer).

Prints tables; no assertions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import struct
import sys
import tempfile
import time
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from storage import Manifest, SnapshotStore  # noqa: E402
from storage.chains import resolve_chain  # noqa: E402
from storage.format import checksum_hex, compression_level, decode_table, delta_for_file, encode_table  # noqa: E402

OP, STATE = "bench", "value"


def key_groups_of(keys: np.ndarray, k: int) -> np.ndarray:
    """A stable 64-bit mix (murmur3 fmix64) of the key, modulo k (benchmark-local)."""
    x = keys.astype(np.uint64)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xFF51AFD7ED558CCD)
        x ^= x >> np.uint64(33)
        x *= np.uint64(0xC4CEB9FE1A85EC53)
        x ^= x >> np.uint64(33)
    return (x % np.uint64(k)).astype(np.int64)


def values_for(keys: np.ndarray, version: int) -> pa.Array:
    cities = np.array(["Berlin", "Lisbon", "Osaka", "Denver", "Nairobi", "Quito", "Perth", "Oslo"])
    counts = (keys * 7 + version * 13) % 10_000
    text = [
        f'{{"user":{k},"count":{c},"city":"{cities[k % 8]}","tier":"gold","v":{version},"ts":17000{k % 99991:05d},"ok":true}}'
        for k, c in zip(keys.tolist(), counts.tolist())
    ]
    return pa.array(text, pa.string())


def split_by_group(table: pa.Table, groups: np.ndarray, k: int, rng: np.random.Generator | None = None) -> dict[int, pa.Table]:
    """Rows per key group, in table order (or shuffled within each group when ``rng`` is given)."""
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.arange(k + 1))
    if rng is not None:
        for g in range(k):
            rng.shuffle(order[bounds[g]:bounds[g + 1]])
    sorted_table = table.take(pa.array(order))
    return {g: sorted_table.slice(bounds[g], bounds[g + 1] - bounds[g]) for g in range(k) if bounds[g + 1] > bounds[g]}


def verdict(ratio: float) -> str:
    return "MEETS target" if ratio <= 1 else "MISSES target"


def mb(n: float) -> float:
    return n / 1e6


# Plain pyarrow, three ways of reading the same files (format 2: IPC streams). The chain read
# is compared with the fastest of them in each round, so that no reader chosen for being slow
# (e.g. OSFile's one read call per IPC message) flatters the store.
PLAIN_READERS = {
    "pa.OSFile": lambda path: pa.ipc.open_stream(pa.OSFile(path)).read_all(),
    "pa.memory_map": lambda path: pa.ipc.open_stream(pa.memory_map(path)).read_all(),
    "whole file, then decode": lambda path: pa.ipc.open_stream(pa.py_buffer(_read_whole(path))).read_all(),
}


def _read_whole(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------ where a file's bytes go
def anatomy(data: bytes) -> Counter:
    """Bytes of one state file by part (format 2 stream; format 1 file framing is counted too)."""
    parts: Counter = Counter()
    pos = 0
    if data[:6] == b"ARROW1":
        footer = struct.unpack("<i", data[-10:-6])[0] + 10
        parts["file magic + footer (schema again, block index)"] += 8 + footer
        pos, end = 8, len(data) - footer
    else:
        end = len(data)
    table = decode_table(data, source="anatomy")
    batches = iter(table.to_batches())
    level = compression_level(table)
    while pos < end:
        length = struct.unpack("<i", data[pos + 4:pos + 8])[0]
        if length == 0:
            parts["end-of-stream marker"] += 8
            pos += 8
            continue
        message = pa.ipc.read_message(pa.BufferReader(data[pos:]))
        body = message.body.size if message.body is not None else 0
        if message.type == "schema":
            parts["schema message (fields + schema metadata)"] += 8 + length
        else:
            parts["record batch header (lengths of nodes and buffers)"] += 8 + length
            framed = 0
            batch = next(batches)
            for name, column in zip(batch.schema.names, batch.columns):
                for i, buf in enumerate(column.buffers()):
                    if buf is None or buf.size == 0:
                        continue
                    part = "validity bitmap" if i == 0 else ("offsets" if i == 1 and len(column.buffers()) == 3 else "data")
                    size = len(pa.Codec("zstd", level).compress(buf, asbytes=True))
                    parts[f"column {name}: {part} (zstd, level {level})"] += size
                    parts["per-buffer framing (8-byte length prefix, padding to 8)"] += 8 + (-size) % 8
                    framed += 8 + size + (-size) % 8
            if framed != body:  # the recompression did not reproduce the writer's buffers
                parts["body (not broken down)"] += body - framed
        pos += 8 + length + body
    return parts


def print_anatomy(files: list[bytes], rows: int, title: str) -> None:
    total = Counter()
    for data in files:
        total.update(anatomy(data))
    size = sum(map(len, files))
    print(f"\n{title}: {len(files)} files, {rows:,} rows, {size:,} bytes ({size / len(files):.0f} B per file, "
          f"{size / max(rows, 1):.1f} B per row)")
    for part, n in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<58} {n:>9,} B  {n / len(files):7.1f} B/file  {n / max(rows, 1):5.2f} B/row  {n / size:6.1%}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--key-groups", type=int, default=128)
    parser.add_argument("--change", type=float, default=0.01, help="share of keys changed for the incremental checkpoint")
    parser.add_argument("--root", help="snapshot root directory (default: a fresh temporary directory, removed after)")
    parser.add_argument("--no-fsync", action="store_true", help="skip fsync of local files")
    parser.add_argument("--shuffle", action="store_true", help="hand rows to the store in random order within a key group")
    parser.add_argument("--anatomy", action="store_true", help="print where the bytes of the delta files go")
    parser.add_argument("--rounds", type=int, default=7, help="read rounds (best one counts)")
    args = parser.parse_args(argv)
    k = args.key_groups
    root = args.root or tempfile.mkdtemp(prefix="abs-bench-storage-")
    if os.path.exists(root) and os.listdir(root):
        print(f"bench_storage: {root} is not empty; pass an empty or new --root", file=sys.stderr)
        return 2
    try:
        return run(args, root, k)
    finally:
        if not args.root:
            shutil.rmtree(root, ignore_errors=True)


def run(args: argparse.Namespace, root: str, k: int) -> int:
    rng = np.random.default_rng(42)
    shuffle_rng = np.random.default_rng(7) if args.shuffle else None
    keys = np.arange(args.keys, dtype=np.int64)
    groups = key_groups_of(keys, k)
    table = pa.table({"key": keys, "value": values_for(keys, 0)})
    store = SnapshotStore.open(root, fsync=not args.no_fsync)
    store.init_job({"job_name": "bench", "max_parallelism": k})
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}

    # 1. full snapshot
    parts = split_by_group(table, groups, k, shuffle_rng)
    t0 = time.perf_counter()
    chains = {g: store.write_key_group(1, OP, STATE, g, [], t.replace_schema_metadata(meta)) for g, t in parts.items()}
    m1 = store.commit(Manifest(checkpoint_id=1, job_name="bench", max_parallelism=k, keyed={OP: {STATE: chains}}))
    full_s = time.perf_counter() - t0
    full_bytes = m1.stats["bytes_written"]

    # 2. incremental checkpoint: change a share of the keys, spread over all key groups
    n_changed = max(1, int(args.keys * args.change))
    changed = np.sort(rng.choice(keys, size=n_changed, replace=False))
    dtable = pa.table({"key": changed, "value": values_for(changed, 1),
                       "op": pa.array(np.zeros(n_changed, np.int8))})
    dparts = split_by_group(dtable, key_groups_of(changed, k), k, shuffle_rng)
    t0 = time.perf_counter()
    chains2 = dict(chains)
    for g, t in dparts.items():
        chains2[g] = store.write_key_group(2, OP, STATE, g, chains[g], t.replace_schema_metadata(meta))
    m2 = store.commit(Manifest(checkpoint_id=2, job_name="bench", max_parallelism=k, keyed={OP: {STATE: chains2}}))
    incr_s = time.perf_counter() - t0
    incr_bytes = m2.stats["bytes_written"]
    n_files = len(dparts)
    # fixed cost per changed key group, strict: the file the store writes for a zero-row delta
    sample = delta_for_file(next(iter(dparts.values())).replace_schema_metadata(meta))
    fixed = encode_table(sample.slice(0, 0), "delta").size
    # looser: the same file with one zero-row record batch, the header every non-empty file adds
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, sample.schema, options=pa.ipc.IpcWriteOptions(
            compression=pa.Codec("zstd", compression_level(sample)))) as writer:
        writer.write_batch(pa.RecordBatch.from_pylist([], schema=sample.schema))
    fixed_batch = sink.getvalue().size
    # loosest: the size-vs-rows intercept 2 x size(n rows) - size(2n rows) of deltas drawn like
    # the ones written, i.e. the part of a delta file that does not grow with its rows
    n = max(1, n_changed // n_files)
    pool = parts[0].column("key").to_numpy()
    picked = np.sort(rng.choice(pool, size=min(2 * n, len(pool)), replace=False))
    half = np.sort(rng.choice(picked, size=len(picked) // 2, replace=False))
    size_of = lambda ks: encode_table(pa.table({"key": ks, "value": values_for(ks, 1)}).replace_schema_metadata(meta),  # noqa: E731
                                      "delta").size
    intercept = 2 * size_of(half) - size_of(picked)
    proportional = 1.2 * args.change * full_bytes
    target = proportional + fixed * n_files
    ratio = incr_bytes / target
    variable = incr_bytes - fixed * n_files

    # 3. read back every chain of checkpoint 2
    refs = [r for ch in chains2.values() for r in ch]
    paths = [os.path.join(root, r.path) for r in refs]
    disk_bytes = sum(r.bytes for r in refs)

    # the timed readers only read; rows and decoded bytes are counted afterwards, untimed
    # (Table.nbytes of a resolved table, a few zero-copy slices, costs ~0.5 ms by itself)
    def plain(reader=PLAIN_READERS["pa.OSFile"]) -> list[pa.Table]:
        return [reader(p) for p in paths]

    def via_store() -> list[pa.Table]:
        return [store.read_chain(ch) for ch in chains2.values()]

    def counts(tables: list[pa.Table]) -> tuple[int, int]:
        return sum(t.num_rows for t in tables), sum(t.nbytes for t in tables)

    def best(fn, repeat: int = 5):
        times, out = [], None
        for _ in range(repeat):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    plain()  # warm the page cache for every reader
    # alternate the readers so that all see the same machine load; keep each one's best, and
    # per round the fastest plain reader as that round's baseline
    by_reader: dict[str, list[float]] = {name: [] for name in PLAIN_READERS}
    plain_times, store_times = [], []
    for _ in range(args.rounds):
        for name, reader in PLAIN_READERS.items():
            t0 = time.perf_counter()
            plain(reader)
            by_reader[name].append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        via_store()
        store_times.append(time.perf_counter() - t1)
        plain_times.append(min(times[-1] for times in by_reader.values()))
    plain_rows, plain_mem = counts(plain())
    store_rows, store_mem = counts(via_store())
    plain_s, store_s = min(plain_times), min(store_times)
    # where read_chain's time goes (each step timed on its own, best of 5)
    fetch_s, blobs = best(lambda: [store._io.get(r.path) for r in refs])
    sum_s, _ = best(lambda: [checksum_hex(b, r.checksum_algorithm) for b, r in zip(blobs, refs)])
    decode_s, decoded = best(lambda: [decode_table(b, source=r.path) for b, r in zip(blobs, refs)])
    by_chain, i = [], 0
    for ch in chains2.values():
        by_chain.append(decoded[i:i + len(ch)])
        i += len(ch)
    resolve_s, _ = best(lambda: [resolve_chain(ts, first_is_base=True) for ts in by_chain])
    check = store.read_chain(chains2[0])
    expected_live = int(pc.sum(pc.equal(pa.array(groups), 0)).as_py())
    assert check.num_rows == expected_live  # sanity, not a benchmark assertion

    raw = table.nbytes
    algo = refs[0].checksum_algorithm
    print(f"storage benchmark: {args.keys:,} int64 keys, ~{raw / args.keys - 8:.0f}-byte values, {k} key groups, "
          f"rows handed {'shuffled' if args.shuffle else 'sorted by key'}, root {root}{' (no fsync)' if args.no_fsync else ''}")
    rows = [
        ("full snapshot: bytes written", f"{mb(full_bytes):.2f} MB",
         f"in-memory Arrow {mb(raw):.1f} MB, {raw / full_bytes:.1f}x smaller, {full_bytes / args.keys:.2f} B/row"),
        ("full snapshot: time", f"{full_s:.2f} s", f"{mb(raw) / full_s:.0f} MB/s of state, {args.keys / full_s / 1e6:.2f} M rows/s"),
        (f"{args.change:.0%} change: keys / key groups", f"{n_changed:,} / {n_files}", f"~{n_changed / n_files:.0f} rows per delta file"),
        (f"{args.change:.0%} change: bytes written", f"{mb(incr_bytes):.3f} MB",
         f"{incr_bytes / full_bytes:.2%} of full, in {incr_s:.2f} s"),
        ("fixed cost per changed key group", f"{fixed} B",
         "= a zero-row delta file of this schema as the store writes it (schema message + end-of-stream)"),
        ("target: 1.2 x share x full + fixed x groups", f"{mb(target):.3f} MB",
         f"{mb(proportional):.3f} MB + {fixed} B x {n_files}"),
        ("written / target", f"{ratio:.2f}", verdict(ratio)),
        ("  row-proportional part / 1.2 x share x full", f"{variable / proportional:.2f}",
         f"(written - fixed x groups) = {mb(variable):.3f} MB: {variable / n_changed:.2f} B per changed row "
         f"vs {full_bytes / args.keys:.2f} B per row in the full snapshot"),
        ("  written / target, fixed = + one zero-row record batch", f"{incr_bytes / (proportional + fixed_batch * n_files):.2f}",
         f"fixed {fixed_batch} B: {verdict(incr_bytes / (proportional + fixed_batch * n_files))}"),
        ("  written / target, fixed = size-vs-rows intercept", f"{incr_bytes / (proportional + intercept * n_files):.2f}",
         f"fixed {intercept} B, the part of a delta file that does not grow with its rows: "
         f"{verdict(incr_bytes / (proportional + intercept * n_files))}; per changed row beyond it "
         f"{(incr_bytes - intercept * n_files) / n_changed:.2f} B"),
        ("chain read: files / on-disk bytes", f"{len(paths)} / {mb(disk_bytes):.2f} MB", "base + delta per key group"),
        *((f"  plain pyarrow: {name}", f"{min(times):.3f} s",
           f"best of {args.rounds}; read_chain's best / this = {store_s / min(times):.2f}")
          for name, times in by_reader.items()),
        ("plain pyarrow.ipc read, fastest way per round", f"{plain_s:.3f} s",
         f"{mb(disk_bytes) / plain_s:.0f} MB/s on disk, {mb(plain_mem) / plain_s:.0f} MB/s decoded, {plain_rows / plain_s / 1e6:.1f} M rows/s (unresolved)"),
        ("store.read_chain (verify + resolve)", f"{store_s:.3f} s",
         f"{mb(disk_bytes) / store_s:.0f} MB/s on disk, {mb(store_mem) / store_s:.0f} MB/s decoded, {store_rows / store_s / 1e6:.1f} M rows/s (live)"),
        ("read_chain time / plain time", f"{store_s / plain_s:.2f}",
         f"best of {args.rounds} alternating rounds; medians {np.median(store_times):.3f} / {np.median(plain_times):.3f} s "
         f"= {np.median(store_times) / np.median(plain_times):.2f}"),
        ("  read_chain steps: fetch / checksum / decode / resolve", f"{(fetch_s + sum_s + decode_s + resolve_s):.3f} s",
         f"{fetch_s * 1e3:.0f} / {sum_s * 1e3:.0f} ({algo}, {mb(disk_bytes) / sum_s:.0f} MB/s) / {decode_s * 1e3:.0f} / {resolve_s * 1e3:.0f} ms"),
    ]
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    for name, value, note in rows:
        print(f"  {name.ljust(w0)}  {value.rjust(w1)}  {note}")
    if args.anatomy:
        deltas = [store._io.get(ch[-1].path) for ch in chains2.values() if ch[-1].kind == "delta"]
        print_anatomy(deltas, n_changed, "delta files of the incremental checkpoint")
        print(f"  (a zero-row delta file: {fixed} B; the table above counts only the parts present)")
        bases = [store._io.get(ch[0].path) for ch in chains.values()]
        print_anatomy(bases, args.keys, "base files of the full snapshot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
