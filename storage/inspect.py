"""Human-readable views of a snapshot root, used by the ``abs-snapshot`` CLI.

Functions return lines of text; they never unpickle unless asked to.
"""
from __future__ import annotations

import datetime as _dt
import json
import pickle
from typing import Any, Iterator, Sequence

import pyarrow as pa

from abscore.ids import id_ranges
from abscore.units import human_bytes

from .errors import CorruptManifestError, StateNotFoundError, StorageError, UnsupportedFormatError
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
    "human_count",
    "human_seconds",
    "parse_storage_options",
]

_MAX_CELL = 60


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
def human_count(n: int) -> str:
    """``12,345``."""
    return f"{n:,}"


def human_seconds(s: Any) -> str:
    """Seconds in the unit that reads best: ``0.06 ms``, ``29.5 ms``, ``1.25 s``."""
    if not isinstance(s, (int, float)) or isinstance(s, bool):
        return str(s)
    ms = s * 1000
    if abs(ms) < 1:
        return f"{ms:.2f} ms"
    if abs(ms) < 1000:
        return f"{ms:.1f} ms" if abs(ms) < 100 else f"{ms:.0f} ms"
    return f"{s:.2f} s"


def _stat_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return _cut(json.dumps(value, sort_keys=True, default=str))
    if key.endswith("_s"):
        return human_seconds(value)
    if key.endswith("bytes") or key in ("full_size",):
        return human_bytes(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    return human_count(value)


_TIMING_KEYS = ("duration_s", "alignment_s", "sync_s", "async_s", "async_cpu_s")
_STORAGE_KEYS = ("bytes_written", "files_written", "full_size", "files", "key_groups", "base_bytes", "delta_bytes",
                 "max_chain_length", "mean_chain_length", "space_amplification", "restore_files", "restore_bytes")


def _num(stats: dict[str, Any], key: str) -> bool:
    value = stats.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _stats_lines(stats: dict[str, Any]) -> list[str]:
    out = []
    s = stats
    if _num(s, "duration_s"):
        parts = [f"{name} {human_seconds(s[key])}" for key, name in
                 (("alignment_s", "alignment"), ("sync_s", "sync"), ("async_s", "async"), ("async_cpu_s", "async CPU"))
                 if _num(s, key)]
        extra = [f"parallelism {s['parallelism']}" if _num(s, "parallelism") else "",
                 f"mode {s['mode']}" if isinstance(s.get("mode"), str) else ""]
        out.append(f"took {human_seconds(s['duration_s'])}" + (f" ({', '.join(parts)})" if parts else "")
                   + "".join(f"; {e}" for e in extra if e))
    if all(_num(s, k) for k in ("bytes_written", "files_written", "full_size", "files")):
        line = (f"storage: wrote {human_bytes(s['bytes_written'])} in {human_count(s['files_written'])} file(s); "
                f"full size {human_bytes(s['full_size'])} in {human_count(s['files'])} file(s)")
        if _num(s, "restore_files") and _num(s, "restore_bytes"):
            line += f"; a restore reads {human_count(s['restore_files'])} file(s) or range(s), {human_bytes(s['restore_bytes'])}"
        if _num(s, "space_amplification"):
            line += f"; space amplification {s['space_amplification']:.2f}"
        out.append(line)
    shown = set(_TIMING_KEYS) | set(_STORAGE_KEYS) | {"parallelism", "mode"}
    if not out:
        shown = set()
    rest = [f"{k} {_stat_value(k, v)}" for k, v in sorted(s.items()) if k not in shown]
    if rest:
        out.append("other stats: " + ", ".join(rest))
    return out


def _ref(ref: FileRef, images: set[str]) -> str:
    kind = "values" if ref.id in images else ref.kind
    return f"{kind}@{ref.checkpoint_id} ({human_bytes(ref.bytes)}, {human_count(ref.rows)} rows)"


def _plural(n: int, noun: str) -> str:
    """``1 delta``, ``2 deltas`` (``noun`` is the plural)."""
    return f"{human_count(n)} {noun[:-1] if n == 1 else noun}"


def _kind_summary(name: str, refs: list[FileRef]) -> str:
    if not refs:
        return f"0 {name}"
    rows = sum(r.rows for r in refs)
    return f"{_plural(len(refs), name)} ({_plural(rows, 'rows')}, {human_bytes(sum(r.bytes for r in refs))})"


def _median(values: list[int]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _state_lines(st: str, chains: dict[int, list[FileRef]], images: set[str], *, key_groups: bool,
                 files: bool) -> list[str]:
    refs = list({r.id: r for chain in chains.values() for r in chain}.values())
    bases = [r for r in refs if r.kind == "base"]
    values = [r for r in refs if r.id in images]
    deltas = [r for r in refs if r.kind == "delta" and r.id not in images]
    lengths = [len(c) for c in chains.values()]
    median = _median(lengths) if lengths else 0
    out = [
        f"    state {st!r}: {human_count(len(chains))} key groups, {human_count(len({r.path for r in refs}))} file(s), "
        f"{human_bytes(sum(r.bytes for r in refs))}",
        f"      {_kind_summary('bases', bases)}, {_kind_summary('values images', values)}, "
        f"{_kind_summary('deltas', deltas)}",
        f"      chain length min {min(lengths, default=0)}, median {median:g}, max {max(lengths, default=0)}",
    ]
    if key_groups or files:
        for kg, chain in sorted(chains.items()):
            out.append(f"      kg {kg:04d}: " + " <- ".join(_ref(r, images) for r in chain))
            if files:
                out.extend(f"        {r.where}" for r in chain)
    return out


def _assignment_line(m: Manifest) -> str:
    """The owner of each key group when the checkpoint was taken."""
    if m.assignment is None:
        p = m.stats.get("parallelism")
        return ("key-group assignment: contiguous ranges" + (f" of parallelism {p}" if isinstance(p, int) else ""))
    owners = m.assignment
    per = "; ".join(f"subtask {w}: {id_ranges((kg for kg, o in enumerate(owners) if o == w), sep=',') or '-'}"
                    for w in range(max(owners) + 1))
    return f"key-group assignment (moved by live reconfiguration): {per}"


def show_lines(manifest: Manifest, *, files: bool = False, key_groups: bool = False,
               values_images: set[str] | None = None, unreadable: Sequence[str] = ()) -> list[str]:
    """A checkpoint summarised per operator and state (human units); ``key_groups`` adds a
    line per key group, ``files`` also the file of every chain member. ``values_images``: the
    :attr:`FileRef.id` of the values images (:meth:`SnapshotStore.values_images`); without it
    they count as deltas. ``unreadable``: files whose kind could not be told (named in a note)."""
    m = manifest
    images = values_images or set()
    out = [
        f"checkpoint {m.checkpoint_id} ({m.kind}{', pinned' if m.pinned else ''}) of job {m.job_name!r}, "
        f"max_parallelism {m.max_parallelism}, created {_iso(m.created_at)}, format {m.format_version}",
        *_stats_lines(m.stats),
        _assignment_line(m),
    ]
    n_states = sum(len(states) for states in m.keyed.values())
    out.append(f"keyed state: {len(m.keyed)} operator(s), {n_states} state(s)" if m.keyed else "keyed state: none")
    for op, states in sorted(m.keyed.items()):
        out.append(f"  operator {op!r}")
        for st, chains in sorted(states.items()):
            out.extend(_state_lines(st, chains, images, key_groups=key_groups, files=files))
    out.append(f"operator state: {len(m.operator_state)} operator(s)" if m.operator_state else "operator state: none")
    for op, subtasks in sorted(m.operator_state.items()):
        refs = list(subtasks.values())
        out.append(f"  operator {op!r} (rule {m.operator_state_rules.get(op, '?')}): {len(refs)} subtask(s), "
                   f"{human_count(sum(r.rows for r in refs))} rows, {human_bytes(sum(r.bytes for r in refs))}")
        if key_groups or files:
            for i, ref in sorted(subtasks.items()):
                out.append(f"    subtask {i}: {_ref(ref, images)}" + (f" {ref.path}" if files else ""))
    logs = m.channel_logs
    out.append(f"channel logs: {len(logs)} file(s), {human_count(sum(r.rows for r in logs))} records, "
               f"{human_bytes(sum(r.bytes for r in logs))}" if logs else "channel logs: none")
    if key_groups or files:
        for ref in logs:
            out.append(f"  {ref.location().task}: {human_count(ref.rows)} records, {_ref(ref, images)}"
                       + (f" {ref.path}" if files else ""))
    out.append("source offsets:" if m.source_offsets else "source offsets: none")
    for op, splits in sorted(m.source_offsets.items()):
        count = f"{len(splits)} split(s)" if isinstance(splits, dict) else "1 value"
        out.append(f"  {op}: {count} " + _cut(json.dumps(splits, sort_keys=True, default=str)))
    out.append("sink transactions:" if m.sink_transactions else "sink transactions: none")
    for op, txn in sorted(m.sink_transactions.items()):
        out.append(f"  {op}: " + _cut(json.dumps(txn, sort_keys=True, default=str)))
    if unreadable:
        out.append(f"note: {len(unreadable)} file(s) could not be read to tell a values image from a delta (counted as "
                   f"deltas), e.g. {unreadable[0]}; run 'abs-snapshot verify' on this root")
    return out


# ---------------------------------------------------------------------- dump
def _cell(value: Any, pickled: bool, unpickle: bool, *, jsonl: bool) -> Any:
    if value is None:
        return None
    if pickled:
        if unpickle:
            try:
                obj = pickle.loads(value)  # only with --unpickle: the user trusts this snapshot
            except Exception as exc:  # noqa: BLE001 - whatever unpickling raises means the same
                raise StorageError(
                    f"a pickled {len(value)}-byte value does not unpickle here ({type(exc).__name__}: {exc}); "
                    "dump without --unpickle shows its bytes, or run where its classes import"
                ) from exc
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


def _rows(batch: pa.RecordBatch, unpickle: bool, jsonl: bool, extra: dict[str, Any]) -> Iterator[dict[str, Any]]:
    flags = {name: is_pickled(batch.schema, name) for name in batch.schema.names}
    for row in batch.to_pylist():
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
    """Resolved rows of a state (one key group or all), as a text table or JSON lines. Files
    are decoded batch by batch where the chain allows it, and reading stops at ``limit``.
    A key group within ``0..max_parallelism-1`` without a chain held no state at this
    checkpoint: it has no rows (said so in a table), which is no error; one outside that range
    raises :class:`StateNotFoundError` naming the range."""
    jsonl = fmt == "jsonl"
    chains = manifest.chains(operator, state)  # names an unknown operator or state first
    if key_group is not None:
        top = manifest.max_parallelism - 1
        if not 0 <= key_group <= top:
            raise StateNotFoundError(
                f"checkpoint {manifest.checkpoint_id}: key group {key_group} is outside 0..{top} (max_parallelism "
                f"{manifest.max_parallelism}); pass a key group from 0 to {top} ('abs-snapshot show ROOT "
                f"{manifest.checkpoint_id} --key-groups' lists those that hold state)"
            )
        if key_group not in chains:
            return [] if jsonl else [f"(no rows: key group {key_group} of {operator}/{state} held no state at "
                                     f"checkpoint {manifest.checkpoint_id})"]
    groups = sorted(chains) if key_group is None else [key_group]
    rows: list[dict[str, Any]] = []
    for kg in groups:
        if limit is not None and len(rows) >= limit:
            break
        for batch in store.iter_key_group(manifest, operator, state, kg):
            if limit is not None:
                batch = batch.slice(0, limit - len(rows))
            rows.extend(_rows(batch, unpickle, jsonl, {"key_group": kg}))
            if limit is not None and len(rows) >= limit:
                break  # the rest of the file is not decoded
    if jsonl:
        return [json.dumps(r, default=str) for r in rows]
    if not rows:
        return ["(no rows)"]
    headers = list(rows[0])
    out = format_table(headers, [[r.get(h) for h in headers] for r in rows])
    if limit is not None and len(rows) >= limit:  # reading stopped there: say so, not as if that were all
        out.append(f"(the first {limit:,} rows: the limit; there may be more; --limit 0 prints every row)")
    return out
