#!/usr/bin/env python
"""Packed state files against a file per key group: what one checkpoint's writes cost.

    .venv/bin/python scripts/bench_packed.py [--keys 1000000] [--key-groups 128] [--rounds 7]
                                             [--root DIR] [--no-s3]

The state of the ABS paper experiment (int64 keys and values, every key changed since the
last checkpoint) written as full key-group images, as a worker's writer does it at every
checkpoint, two ways in alternating rounds:

* ``per key group``: ``SnapshotStore.write_key_group`` once per key group (one file each; on
  an object store 16 at a time, as the writer process did before packed files);
* ``packed``: ``SnapshotStore.write_key_groups`` (one packed file for the state).

Each round commits a checkpoint, then deletes the files of the one before it, as the job's
GC does every second (file systems may handle the creates after deletes differently from
creates into a quiet directory). Backends: local disk (``--root``, default a temporary
directory) and, unless ``--no-s3``, a moto S3 server on 127.0.0.1 started as a subprocess (so
that this process's CPU time is the client's alone). Prints the median wall time and CPU time
of this process per checkpoint and the ratios packed / per key group, measured in this run.
No assertions.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from abs.keygroups import key_groups  # noqa: E402
from storage import Manifest, SnapshotStore  # noqa: E402
from storage.store import KeyGroupWrite  # noqa: E402

OP, STATE = "count", "n"
_S3_THREADS = 16  # what the writer process used for per-key-group PUTs


def images(keys: int, k: int, version: int) -> dict[int, pa.Table]:
    key = np.arange(keys, dtype=np.int64)
    groups = key_groups(key, k).astype(np.int64)
    order = np.argsort(groups, kind="stable")
    bounds = np.searchsorted(groups[order], np.arange(k + 1))
    meta = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
    out = {}
    for g in range(k):
        rows = order[bounds[g]:bounds[g + 1]]
        out[g] = pa.table({"key": key[rows], "value": key[rows] * 3 + version}).replace_schema_metadata(meta)
    return out


def write_per_key_group(store: SnapshotStore, cid: int, tables: dict[int, pa.Table]) -> dict[int, list]:
    def one(g: int) -> list:
        return store.write_key_group(cid, OP, STATE, g, [], tables[g], complete=True)

    if store.object_store:
        with ThreadPoolExecutor(_S3_THREADS) as pool:
            return dict(zip(tables, pool.map(one, tables)))
    return {g: one(g) for g in tables}


def write_packed(store: SnapshotStore, cid: int, tables: dict[int, pa.Table]) -> dict[int, list]:
    jobs = [KeyGroupWrite(OP, STATE, g, [], t, True) for g, t in tables.items()]
    return dict(zip(tables, store.write_key_groups(cid, jobs)))


MODES = {"per key group": write_per_key_group, "packed": write_packed}


def run_backend(name: str, store: SnapshotStore, tables: list[dict[int, pa.Table]], rounds: int) -> None:
    k = len(tables[0])
    store.init_job({"job_name": "bench-packed", "max_parallelism": k})
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    files: dict[str, int] = {}
    cid = 0
    for r in range(rounds + 1):  # round 0 warms up (imports, connections, page cache)
        for mode in (list(MODES) if r % 2 else list(MODES)[::-1]):
            cid += 1
            w0, c0 = time.perf_counter(), time.process_time()
            chains = MODES[mode](store, cid, tables[cid % 2])
            store.commit(Manifest(checkpoint_id=cid, job_name="bench-packed", max_parallelism=k,
                                  keyed={OP: {STATE: chains}}))
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
            store.gc(retain=1)  # the previous checkpoint's files go, as the job's GC does
            if r:
                times[mode].append((wall, cpu))
                files[mode] = len(store.read_manifest(cid).paths())
    print(f"\n{name}: {k} key-group images per checkpoint, {rounds} rounds (median per checkpoint)")
    print(f"  {'mode':<14} {'files':>6} {'wall ms':>9} {'CPU ms':>8}")
    med = {}
    for mode, samples in times.items():
        med[mode] = (statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples))
        print(f"  {mode:<14} {files[mode]:>6} {med[mode][0] * 1e3:>9.1f} {med[mode][1] * 1e3:>8.1f}")
    (pw, pc), (kw, kc) = med["packed"], med["per key group"]
    print(f"  packed / per key group: wall {pw / kw:.2f}, CPU {pc / kc:.2f}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--key-groups", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--root", help="parent directory for the local root (default: a temporary directory)")
    parser.add_argument("--no-s3", action="store_true", help="skip the moto S3 backend")
    args = parser.parse_args(argv)
    tables = [images(args.keys, args.key_groups, v) for v in (0, 1)]
    parent = tempfile.mkdtemp(prefix="abs-bench-packed-", dir=args.root)
    try:
        run_backend(f"local disk ({parent})", SnapshotStore.open(os.path.join(parent, "root")), tables, args.rounds)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    if args.no_s3:
        return 0
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        options = {"key": "bench", "secret": "bench", "endpoint_url": f"http://127.0.0.1:{port}"}
        import fsspec

        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        deadline = time.monotonic() + 30
        while True:
            try:
                fs.mkdir("bench")
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        store = SnapshotStore.open(f"s3://bench/{uuid.uuid4().hex}", options)
        run_backend("moto S3 on loopback (a subprocess)", store, tables, max(3, args.rounds // 2))
    finally:
        server.terminate()
        server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
