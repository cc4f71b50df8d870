"""What a savepoint of a job with a Spark source carries of its batch log
(:mod:`abs.connectors.batchlog`): the batches from the checkpoint's bound on, the markers and,
for micro-batches, Spark's checkpoint, copied into ``<savepoint>/sources/<uid>/``; a restore
from that savepoint reads the copy."""
from __future__ import annotations

import json
import time
import urllib.parse
from typing import Any, Mapping

from .batchlog import SparkSourceError, _canonical, _Log
from .fs import absolute
from .sources import SourceContext

# --------------------------------------------------------------------------- savepoint copies

_COPY_MARKER = "_savepoint.json"
_COPIED_MARKERS = ("_end.json", "_committed.json", "_consumed.json")


def _savepoint_log(dest: str, options: Mapping[str, Any] | None, uid: str) -> _Log:
    """Where a savepoint at ``dest`` keeps its copy of source ``uid``'s log."""
    return _Log(absolute(f"{dest.rstrip('/')}/sources/{urllib.parse.quote(uid, safe='')}"), options)


def _files_below(log: _Log, name: str) -> list[str]:
    """Paths relative to directory ``name`` of the log (``""``: its root) of the files below
    it, sorted; ``[]`` if it does not exist."""
    base = log.path(name) if name else log.root
    files, _root = log._open()
    files.refresh(base)
    try:
        found = log.fs.find(base)
    except FileNotFoundError:
        return []
    strip = base.split("://", 1)[-1].rstrip("/")
    out = []
    for path in found:
        rel = str(path).split("://", 1)[-1][len(strip):].lstrip("/")
        if rel:
            out.append(rel)
    return sorted(out)


def _copy_files(src: _Log, dst: _Log, paths: list[str], what: str) -> None:
    """Copy the files ``paths`` (relative to the roots) from ``src`` to ``dst``, in this order."""
    for rel in paths:
        data = src.read(src.path(rel))
        if data is None:
            raise SparkSourceError(
                f"{what}: {src.path(rel)} disappeared while the savepoint copied the log; take the savepoint again"
            )
        dst.put(dst.path(rel), data)


def _copy_tree(src: _Log, name: str, dst: _Log, dst_name: str, what: str, *, temporary: bool = False) -> None:
    """Copy directory ``name`` of ``src`` (``""``: its root) to ``dst_name`` of ``dst``, a
    ``_manifest.json`` last (a partial copy never reads as a staged batch). ``temporary``:
    files may come and go meanwhile (Spark's temporary files): skip those."""
    files = _files_below(src, name)
    files.sort(key=lambda p: p.endswith("_manifest.json"))
    for rel in files:
        if temporary and rel.endswith(".tmp"):
            continue
        path = src.path(name, rel) if name else src.path(rel)
        data = src.read(path)
        if data is None and temporary:
            continue
        if data is None:
            raise SparkSourceError(
                f"{what}: {path} disappeared while the savepoint copied the log; take the savepoint again"
            )
        dst.put(dst.path(dst_name, rel) if dst_name else dst.path(rel), data)


def _write_copy_marker(dst: _Log, offsets: Mapping[str, Any], batches: list[int]) -> None:
    body = {"v": 1, "offsets": dict(offsets), "batches": batches, "copied_at": time.time()}
    dst.put(dst.path(_COPY_MARKER), json.dumps(body).encode())


def _savepoint_copy(what: str, context: SourceContext, restored: Mapping[str, Any]) -> _Log | None:
    """The log copy of the savepoint this attempt restores, if it has one made for exactly
    these offsets (``None``: restore from the job's own log)."""
    if not restored or context.restored_from is None:
        return None
    options = context.restored_from_options if context.restored_from_options is not None else context.storage_options
    copy = _savepoint_log(context.restored_from, options, context.uid)
    marker = copy.read_json(copy.path(_COPY_MARKER))
    if marker is None:
        return None
    if _canonical(marker.get("offsets")) != _canonical(dict(restored)):
        raise SparkSourceError(
            f"{what}: the log copy in {copy.url} was made for other offsets than the checkpoint restored from "
            f"{context.restored_from} ({marker.get('offsets')} != {dict(restored)}); was the savepoint's "
            "directory mixed with another one? Restore a savepoint as JobHandle.savepoint wrote it"
        )
    return copy


