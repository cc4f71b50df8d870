"""Human-readable views of a snapshot root, used by the ``abs-snapshot`` CLI.

Functions return lines of text; they never unpickle unless asked to.
"""
from __future__ import annotations

import datetime as _dt
import json
import pickle
from typing import Any, Iterator, Sequence

import pyarrow as pa

from .errors import CorruptManifestError, StorageError, UnsupportedFormatError
from .format import is_pickled
from .manifest import FileRef, Manifest
from .store import SnapshotStore

__all__ = [
    "format_table",
    "list_lines",
    "corrupt_lines",
    "show_lines",
    "dump_lines",
    "human_bytes",
    "parse_storage_options",
]

_MAX_CELL = 60


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    """Left-aligned text table; cells longer than 60 characters are cut."""
    cells = [[_cut(str(c)) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths)).rstrip()  # noqa: E731
    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells]


def _cut(text: str) -> str:
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."


def parse_storage_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``key=value`` pairs into storage options; values are JSON if they parse, else strings;
    dotted keys nest (``client_kwargs.region_name=eu-west-1``)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"storage option {pair!r} is not key=value")
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        target = options
        *parents, leaf = key.split(".")
        for part in parents:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ValueError(f"storage option {pair!r} nests into a non-object")
        target[leaf] = value
    return options


# ---------------------------------------------------------------------- ls
def list_lines(store: SnapshotStore) -> list[str]:
    """One row per manifest, corrupt ones included (status ``corrupt: <reason>``: not a
    checkpoint, never restored, not trusted by GC)."""
    rows: list[list[Any]] = []
    for cid, m in store.list_manifests().items():
        if isinstance(m, UnsupportedFormatError):
            rows.append([cid, "?", "newer format: upgrade to read it", "-", "-", "-", "-", "-"])
            continue
        if isinstance(m, StorageError):
            rows.append([cid, "?", f"corrupt: {getattr(m, 'reason', 'unreadable')}", "-", "-", "-", "-", "-"])
            continue
        s = m.stats
        rows.append([
            cid, m.kind, "ok", _iso(m.created_at), human_bytes(s.get("bytes_written")), human_bytes(s.get("full_size")),
            s.get("files", "-"), s.get("max_chain_length", "-"),
        ])
    if not rows:
        return [f"{store.url}: no complete checkpoints"]
    return format_table(["id", "kind", "status", "created", "written", "full size", "files", "max chain"], rows)


def corrupt_lines(store: SnapshotStore, *, newer_than: int = 0) -> list[str]:
    """A note per corrupt manifest with an id above ``newer_than``."""
    return [f"note: checkpoint {cid}: manifest is corrupt ({err.reason}); it is not a checkpoint and is skipped; "
            f"'abs-snapshot show ROOT {cid}' or 'verify' says more"
            for cid, err in store.list_manifests().items()
            if isinstance(err, CorruptManifestError) and cid > newer_than]


# ---------------------------------------------------------------------- show
def _ref(ref: FileRef) -> str:
    return f"{ref.kind}@{ref.checkpoint_id} ({human_bytes(ref.bytes)}, {ref.rows} rows)"


def show_lines(manifest: Manifest, *, files: bool = False) -> list[str]:
    m = manifest
    out = [
        f"checkpoint {m.checkpoint_id} ({m.kind}{', pinned' if m.pinned else ''}) of job {m.job_name!r}, "
        f"max_parallelism {m.max_parallelism}, created {_iso(m.created_at)}, format {m.format_version}",
        "stats: " + json.dumps(m.stats, sort_keys=True, default=str),
        "keyed state:" if m.keyed else "keyed state: none",
    ]
    for op, states in sorted(m.keyed.items()):
        out.append(f"  operator {op!r}")
        for st, chains in sorted(states.items()):
            refs = {r.id: r for chain in chains.values() for r in chain}
            longest = max((len(c) for c in chains.values()), default=0)
            n_files = len({r.path for r in refs.values()})
            out.append(
                f"    state {st!r}: {len(chains)} key groups, {n_files} files, "
                f"{human_bytes(sum(r.bytes for r in refs.values()))}, max chain {longest}"
            )
            for kg, chain in sorted(chains.items()):
                out.append(f"      kg {kg:04d}: " + " <- ".join(_ref(r) for r in chain))
                if files:
                    out.extend(f"        {r.where}" for r in chain)
    out.append("operator state:" if m.operator_state else "operator state: none")
    for op, subtasks in sorted(m.operator_state.items()):
        out.append(f"  operator {op!r} (rule {m.operator_state_rules.get(op, '?')})")
        for i, ref in sorted(subtasks.items()):
            out.append(f"    subtask {i}: {_ref(ref)}" + (f" {ref.path}" if files else ""))
    out.append(f"channel logs: {len(m.channel_logs)}")
    for ref in m.channel_logs:
        out.append(f"  {ref.location().task}: {_ref(ref)}" + (f" {ref.path}" if files else ""))
    out.append("source offsets: " + json.dumps(m.source_offsets, sort_keys=True, default=str))
    out.append("sink transactions: " + json.dumps(m.sink_transactions, sort_keys=True, default=str))
    return out


# ---------------------------------------------------------------------- dump
def _cell(value: Any, pickled: bool, unpickle: bool, *, jsonl: bool) -> Any:
    if value is None:
        return None
    if pickled:
        if unpickle:
            obj = pickle.loads(value)  # only with --unpickle: the user trusts this snapshot
            if not jsonl:
                return repr(obj)
            try:
                json.dumps(obj)
                return obj
            except (TypeError, ValueError):
                return repr(obj)
        return {"pickled_hex": value.hex()} if jsonl else f"<pickled {len(value)} bytes>"
    if isinstance(value, (bytes, bytearray)):
        return {"hex": bytes(value).hex()} if jsonl else "0x" + bytes(value).hex()
    return value


def _rows(table: pa.Table, unpickle: bool, jsonl: bool, extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
    flags = {name: is_pickled(table.schema, name) for name in table.schema.names}
    for row in table.to_pylist():
        out = dict(extra)
        for name, value in row.items():
            out[name] = _cell(value, flags[name], unpickle, jsonl=jsonl)
        yield out


def dump_lines(
    store: SnapshotStore,
    manifest: Manifest,
    operator: str,
    state: str,
    *,
    key_group: int | None = None,
    fmt: str = "table",
    limit: int | None = 100,
    unpickle: bool = False,
) -> list[str]:
    """Resolved rows of a state (one key group or all), as a text table or JSON lines."""
    jsonl = fmt == "jsonl"
    groups = sorted(manifest.chains(operator, state)) if key_group is None else [key_group]
    rows: list[dict[str, Any]] = []
    for kg in groups:
        remaining = None if limit is None else limit - len(rows)
        if remaining is not None and remaining <= 0:
            break
        table = store.read_key_group(manifest, operator, state, kg)
        if remaining is not None:
            table = table.slice(0, remaining)
        rows.extend(_rows(table, unpickle, jsonl, {"key_group": kg}))
    if jsonl:
        return [json.dumps(r, default=str) for r in rows]
    if not rows:
        return ["(no rows)"]
    headers = list(rows[0])
    return format_table(headers, [[r.get(h) for h in headers] for r in rows])

