"""The JSON documents of a root (manifests, ``_job.json``): parsed with bounded cost (size,
nesting, integers), and the manifest checksum over their canonical encoding."""
from __future__ import annotations

import json
import re
from typing import Any, Mapping

from .checksums import WRITE_CHECKSUM_ALGORITHM, checksum_hex
from .errors import CorruptManifestError

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_INT",
    "json_depth_exceeds",
    "layout_json",
    "parse_json_document",
    "manifest_checksum",
]

MAX_MANIFEST_BYTES = 256 << 20
"""A manifest or ``_job.json`` larger than this is refused before it is parsed (bounded memory).
A manifest of 32,768 key groups with chains of 10 files per state was about 80 MiB per state in
format 6 (every reference spelled out); in format 7 it is a few MiB (see :mod:`storage.manifest_refs`)."""

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
    """Whether arrays/objects nest deeper than ``limit`` in ``value`` (level by level: no recursion)."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        below: list[Any] = []
        for item in level:
            below.extend([c for c in (item.values() if isinstance(item, dict) else item) if isinstance(c, (dict, list))])
        level = below
    return False


def layout_json(doc: Any, width: int = 100) -> str:
    """``doc`` as JSON laid out for reading: an array or object whose compact form is longer
    than ``width`` characters gets one line per item (indented one space per level), anything
    shorter stays on one line. A manifest thus shows one line per file, range and key group's
    chain, without the whitespace of one line per number."""
    return _layout(doc, "", width)


_compact = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _is_refs(value: Any) -> bool:
    """Whether ``value`` is a list of lists of integers (a chain of references of format 7)."""
    return type(value) is list and all(type(e) is list and all(type(x) is int for x in e) for e in value)


def _compact_refs(value: list[list[int]]) -> str:
    """``_compact`` of a list of lists of integers, without the encoder's cost per call (a
    manifest has one such list per key group)."""
    return "[" + ",".join(["[" + ",".join(map(str, e)) + "]" for e in value]) + "]"


def _key(key: Any) -> str:
    """An object key as JSON writes it (a string; ``1``, ``True``, ``None`` as ``"1"``, ...)."""
    return _compact(key) if isinstance(key, str) else _compact({key: 0})[1:-3]


_CHAINS = re.compile(r'\{"\d+":\[[\[\],\d-]*\](?:,"\d+":\[[\[\],\d-]*\])*\}')
"""The compact form of an object of integer keys (digits) whose values are arrays of arrays of
integers (or empty): a state's chains by key group in a manifest."""


def _layout_chains(value: dict, inner: str, width: int) -> str | None:
    """The items :func:`_layout` lays out, one per line, of ``value`` when it is an object of
    integer keys whose values are arrays of arrays of integers, each short enough for one line
    (a state's chains by key group: thousands of them), from one encoder call and string
    operations over its output; ``None`` for any other object."""
    compact = _compact(value)
    if not _CHAINS.fullmatch(compact):
        return None
    # no quote but the keys': items are split at each ',"', and a key ends at its '":'
    pieces = compact[1:-1].split(',"')
    if max(map(len, pieces)) > width:  # a key and its value: that value might not fit one line
        return None
    return inner + (",\n" + inner + '"').join(pieces).replace('":', '": ')


def _exceeds(value: dict | list, width: int) -> bool:
    """Whether the compact form of ``value`` is surely longer than ``width`` characters, from a
    walk that counts the least each part costs (brackets, a key's quotes and colon, a comma, a
    character per number) and stops once past ``width``: an object that holds a few objects
    of thousands of items is not encoded whole to learn that it does not fit."""
    total = 0
    stack: list = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            total += 1 + 4 * len(v) if v else 2
            stack.extend(v.values())
        elif isinstance(v, list):
            total += 1 + len(v) if v else 2
            stack.extend(v)
        else:
            total += 1
        if total > width:
            return True
    return False


def _layout(value: Any, indent: str, width: int) -> str:
    if not isinstance(value, (dict, list)):
        return _compact(value)
    if isinstance(value, dict) and 2 * len(value) > width:
        lines = _layout_chains(value, indent + " ", width)
        if lines is not None:
            return "{\n" + lines + "\n" + indent + "}"
    if 2 * len(value) <= width and not (len(value) < 8 and _exceeds(value, width)):
        # else no compact form fits: every item costs a character and a comma
        compact = _compact_refs(value) if _is_refs(value) else _compact(value)
        if len(compact) <= width:
            return compact
    inner = indent + " "
    if isinstance(value, list) and value and all(type(e) is list for e in value):
        # one encoder call for a long list of arrays (a manifest's ranges): split its compact form
        # at the "],[" between items; a string holding "],[" would split more often: then item by item
        pieces = _compact(value)[2:-2].split("],[")
        if len(pieces) == len(value) and all(len(p) + 2 <= width for p in pieces) \
                and not any(isinstance(x, (dict, list)) for e in value for x in e):
            return "[\n" + ",\n".join(f"{inner}[{p}]" for p in pieces) + "\n" + indent + "]"
    if isinstance(value, dict):
        items = [f"{inner}{_key(k)}: {_layout(v, inner, width)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return "[\n" + ",\n".join(inner + _layout(v, inner, width) for v in value) + "\n" + indent + "]"


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
