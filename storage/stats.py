"""Storage figures of a checkpoint, computed from its manifest alone (pure)."""
from __future__ import annotations

from typing import Any

from .manifest import Manifest

__all__ = ["storage_stats", "STORAGE_STAT_KEYS"]

STORAGE_STAT_KEYS = (
    "bytes_written",
    "files_written",
    "full_size",
    "files",
    "key_groups",
    "base_bytes",
    "delta_bytes",
    "max_chain_length",
    "mean_chain_length",
    "space_amplification",
    "restore_files",
    "restore_bytes",
)


def storage_stats(manifest: Manifest) -> dict[str, Any]:
    """The figures :meth:`SnapshotStore.commit` adds to ``Manifest.stats``.

    - ``bytes_written`` / ``files_written``: bytes and distinct files first written by this
      checkpoint (their ``checkpoint_id`` equals the manifest's; a packed file counts once);
    - ``full_size`` / ``files``: bytes of all distinct references, and the distinct files they
      are in (a packed file counts once);
    - ``key_groups``: number of (operator, state, key group) chains;
    - ``base_bytes`` / ``delta_bytes``: keyed bytes referenced, split by file kind;
    - ``max_chain_length`` / ``mean_chain_length``: files per chain (0 without keyed state);
    - ``space_amplification``: (base_bytes + delta_bytes) / base_bytes, i.e. how much more
      keyed storage the chains hold than their compacted bases would (1.0 = fully compacted;
      ``None`` without keyed state). The bases are the size estimate of the live state;
    - ``restore_files`` / ``restore_bytes``: what a full restore reads (reads: distinct files and
      ranges of packed files; bytes). A key group in a shared range of a packed file (format 6)
      counts its share of the range's bytes; a restore reads the whole range, once.
    """
    files = manifest.files()
    cid = manifest.checkpoint_id
    written = [ref for ref in files.values() if ref.checkpoint_id == cid]
    paths = {ref.path for ref in files.values()}
    lengths = [len(chain) for states in manifest.keyed.values() for chains in states.values() for chain in chains.values()]
    keyed = {ref.id: ref for states in manifest.keyed.values() for chains in states.values()
             for chain in chains.values() for ref in chain}
    base_bytes = sum(ref.bytes for ref in keyed.values() if ref.kind == "base")
    delta_bytes = sum(ref.bytes for ref in keyed.values() if ref.kind == "delta")
    full = sum(ref.bytes for ref in files.values())
    reads = {ref.range_id: ref.read_size for ref in files.values()}  # a shared range is read whole, once
    if keyed:
        amplification: float | None = round((base_bytes + delta_bytes) / base_bytes, 4) if base_bytes else None
    else:
        amplification = None
    return {
        "bytes_written": sum(ref.bytes for ref in written),
        "files_written": len({ref.path for ref in written}),
        "full_size": full,
        "files": len(paths),
        "key_groups": len(lengths),
        "base_bytes": base_bytes,
        "delta_bytes": delta_bytes,
        "max_chain_length": max(lengths, default=0),
        "mean_chain_length": round(sum(lengths) / len(lengths), 4) if lengths else 0.0,
        "space_amplification": amplification,
        "restore_files": len(reads),  # a range of a packed file is one read
        "restore_bytes": sum(reads.values()),
    }
