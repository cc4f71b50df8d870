"""The JSON documents of a root (manifests, ``_job.json``): parsed with bounded cost (size,
nesting, integers), and the manifest checksum over their canonical encoding."""
from __future__ import annotations

import json
from typing import Any, Mapping

from .checksums import WRITE_CHECKSUM_ALGORITHM, checksum_hex
from .errors import CorruptManifestError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_INT",
    "json_depth_exceeds",
    "parse_json_document",
    "manifest_checksum",
]

MAX_MANIFEST_BYTES = 256 << 20
"""A manifest or ``_job.json`` larger than this is refused before it is parsed (bounded memory).
A manifest of 32,768 key groups with chains of 10 files per state is about 80 MiB per state."""

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects a manifest or ``_job.json`` may have (a manifest's own
structure is 7 deep; source offsets, sink transactions and stats are the runtime's small JSON
values)."""

MAX_INT = (1 << 63) - 1
"""Largest id, size, offset or row count a manifest may hold (a signed 64-bit integer)."""

_CHECKSUM_KEYS = ("checksum", "checksum_algorithm")


def _short(value: Any) -> str:
    """``repr`` of a value for a message, cut (a hostile manifest may hold huge values)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:20]}...({len(text)} characters)"


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether arrays/objects nest deeper than ``limit`` in ``value`` (iterative: no recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def parse_json_document(raw: str | bytes, *, source: str, what: str = "manifest",
                        max_bytes: int = MAX_MANIFEST_BYTES) -> Any:
    """Parse a manifest or ``_job.json`` with bounded cost: refuse more than ``max_bytes``
    bytes, nesting deeper than :data:`MAX_JSON_DEPTH`, and what does not parse, with one
    :class:`CorruptManifestError` naming ``source``."""
    verdict = ("the checkpoint is incomplete or corrupt; restore from another checkpoint" if what == "manifest"
               else "the root's job fingerprint is corrupt; restore it from a backup or use another storage root")
    if len(raw) > max_bytes:
        raise CorruptManifestError(
            f"{source}: {len(raw)} bytes, more than the {max_bytes} a {what} may have; refusing to parse it; {verdict}",
            reason=f"larger than {max_bytes} bytes")
    try:
        data = json.loads(raw)
    except RecursionError:
        data = None
        deep = True
    except (ValueError, UnicodeDecodeError) as exc:
        reason = str(exc)[:200]
        raise CorruptManifestError(f"{source}: does not parse as JSON ({reason}); {verdict}",
                                   reason="does not parse as JSON") from None
    else:
        deep = json_depth_exceeds(data, MAX_JSON_DEPTH)
    if deep:
        raise CorruptManifestError(
            f"{source}: arrays or objects nest deeper than {MAX_JSON_DEPTH} levels; refusing to read it; {verdict}",
            reason=f"nested deeper than {MAX_JSON_DEPTH} levels")
    return data


def manifest_checksum(data: Mapping[str, Any], algorithm: str = WRITE_CHECKSUM_ALGORITHM) -> str:
    """The checksum of a manifest: ``algorithm`` over its canonical encoding (UTF-8 of
    ``json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    allow_nan=False)`` of the parsed document without its ``checksum`` and
    ``checksum_algorithm`` keys)."""
    body = {k: v for k, v in data.items() if k not in _CHECKSUM_KEYS}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return checksum_hex(text.encode("ascii"), algorithm)
