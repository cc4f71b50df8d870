"""Opening the snapshot root the ``abs-snapshot`` data source reads: on the driver afresh,
on the executors one cached store per root and storage options in each Python worker."""
from __future__ import annotations

import json
import threading
from typing import Any, Mapping

from .errors import StorageError
from .spark_options import _Options
from .store import SnapshotStore

_STORES: dict[tuple[str, str], SnapshotStore] = {}
_STORES_LOCK = threading.Lock()


def _open_store(root: str, storage_options: Mapping[str, Any], *, cached: bool = False) -> SnapshotStore:
    """Open a root; with ``cached`` (executors), reuse one store per root and options in this
    Python worker (s3fs sessions are expensive to build; stores are thread-safe)."""
    if not cached:
        return SnapshotStore.open(root, storage_options)
    key = (root, json.dumps(storage_options, sort_keys=True, default=str))
    with _STORES_LOCK:
        store = _STORES.get(key)
    if store is None:
        store = SnapshotStore.open(root, storage_options, check=False)
        with _STORES_LOCK:
            store = _STORES.setdefault(key, store)
    return store


def _open_existing(opts: _Options) -> SnapshotStore:
    store = _open_store(opts.root, opts.storage_options)
    if not store.exists():
        raise StorageError(
            f"{opts.root}: holds no snapshots (no _job.json, no manifests); check the path or URL "
            "(and the storage.* options)"
        )
    return store
