"""The offline report of a snapshot root (``abs-snapshot report ROOT --output report.html``):
one self-contained HTML file with inline SVG charts drawn here, no script and nothing loaded
from the network, so it opens from disk anywhere.

:func:`collect_report` reads the root through :class:`storage.SnapshotStore` (its manifests,
their stats, its file listing and a GC plan that keeps every checkpoint, which says which files
no manifest references, unless a manifest of a newer format may reference any of them);
:func:`render_report` turns that :class:`ReportData` into the page (pure). Every chart mark
carries its number in ``data-value`` (and a ``<title>`` tooltip), so the page can be checked
against the manifests.
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import html
from typing import Any, Callable, Sequence

from storage import SnapshotStore, StorageError
from storage.errors import UnsupportedFormatError
from storage.inspect import human_bytes, human_seconds

__all__ = ["ReportData", "CheckpointRow", "StateRow", "collect_report", "render_report", "EmptyRootError",
           "TOP_KEY_GROUPS"]

TOP_KEY_GROUPS = 15
"""The report lists this many of the newest checkpoint's largest key groups."""


class EmptyRootError(StorageError):
    """The root holds no checkpoint that reads: nothing to report on. Remedy: check the path,
    or see ``abs-snapshot ls ROOT`` / ``verify`` for why its manifests do not read."""


@dataclasses.dataclass(frozen=True)
class CheckpointRow:
    checkpoint_id: int
    kind: str
    created_at: float
    duration_s: float | None
    alignment_s: float | None
    bytes_written: int
    full_size: int
    files: int
    max_chain_length: int
    space_amplification: float | None


@dataclasses.dataclass(frozen=True)
class StateRow:
    """One keyed state of the newest checkpoint."""

    operator: str
    state: str
    key_groups: int
    max_chain_length: int
    mean_chain_length: float
    base_bytes: int
    delta_bytes: int

    @property
    def space_amplification(self) -> float | None:
        return round((self.base_bytes + self.delta_bytes) / self.base_bytes, 4) if self.base_bytes else None


@dataclasses.dataclass(frozen=True)
class ReportData:
    root: str
    job_name: str
    max_parallelism: int
    checkpoints: tuple[CheckpointRow, ...]
    corrupt: tuple[tuple[int, str], ...]
    newest: int
    states: tuple[StateRow, ...]
    key_groups: tuple[tuple[str, int], ...]  # "operator/state kg N", bytes: the largest first
    referenced_bytes: int  # distinct files any manifest references
    garbage_bytes: int | None  # files no manifest references, older than the newest checkpoint (gc deletes them)
    in_flight_bytes: int | None  # unreferenced files newer than the newest checkpoint (in flight, or a failed attempt's)
    packed_dead_bytes: int | None  # bytes of kept packed files that no manifest references
    metadata_bytes: int | None  # manifests, _job.json, pins, commit records
    generated_at: float
    # why the four above are None: a manifest of a newer format may reference any file, so no
    # file can be called unreferenced (GC refuses such a root for the same reason)
    garbage_unknown: str | None = None


def _num(stats: dict, key: str) -> float | None:
    v = stats.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def collect_report(store: SnapshotStore, *, now: Callable[[], float] | None = None) -> ReportData:
    """What the report shows, read from ``store``; :class:`EmptyRootError` when no manifest reads."""
    import time

    from storage.stats import storage_stats

    manifests, corrupt, newer = {}, [], []
    for cid, m in store.list_manifests().items():
        if isinstance(m, UnsupportedFormatError):
            corrupt.append((cid, f"written by a newer format ({m}); upgrade to read it"))
            newer.append(cid)
        elif isinstance(m, StorageError):
            corrupt.append((cid, getattr(m, "reason", None) or str(m)))
        else:
            manifests[cid] = m
    if not manifests:
        why = f"; {len(corrupt)} manifest(s) do not read (first: checkpoint {corrupt[0][0]}: {corrupt[0][1]})" if corrupt else ""
        raise EmptyRootError(f"{store.url}: holds no checkpoint that reads, nothing to report on{why}; "
                             "'abs-snapshot ls ROOT' and 'verify' say more")
    rows = []
    for cid, m in sorted(manifests.items()):
        s = dict(m.stats)
        if not all(_num(s, k) is not None for k in ("bytes_written", "full_size", "files")):
            s.update(storage_stats(m))  # a manifest written without them (older writers)
        rows.append(CheckpointRow(cid, m.kind, m.created_at, _num(s, "duration_s"), _num(s, "alignment_s"),
                                  int(s["bytes_written"]), int(s["full_size"]), int(s["files"]),
                                  int(s.get("max_chain_length") or 0), _num(s, "space_amplification")))
    newest_id = max(manifests)
    newest = manifests[newest_id]
    states, groups = [], []
    for op, per_state in sorted(newest.keyed.items()):
        for state, chains in sorted(per_state.items()):
            lengths = [len(chain) for chain in chains.values()]
            refs = {ref.id: ref for chain in chains.values() for ref in chain}
            states.append(StateRow(op, state, len(chains), max(lengths, default=0),
                                   round(sum(lengths) / len(lengths), 4) if lengths else 0.0,
                                   sum(r.bytes for r in refs.values() if r.kind == "base"),
                                   sum(r.bytes for r in refs.values() if r.kind == "delta")))
            for kg, chain in chains.items():
                groups.append((f"{op}/{state} kg {kg}", sum(r.bytes for r in chain)))
    groups.sort(key=lambda g: (-g[1], g[0]))
    listing = store.list_files()
    referenced = {ref.path for m in manifests.values() for ref in m.files().values()}
    garbage = in_flight = packed_dead = metadata = None
    unknown = None
    if newer:  # the GC plan refuses such a root: it cannot tell which files those manifests reference
        unknown = (f"the manifest of checkpoint {min(newer)} is of a newer storage format and may reference any file, "
                   "so no file is counted as garbage; upgrade the toolkit to see the garbage")
    else:
        plan = store.plan_gc(max(1, len(manifests) + len(corrupt)))  # keeps every checkpoint: names the unreferenced files
        garbage = sum(listing.get(p, 0) for p in plan.delete_files)
        in_flight = sum(listing.get(p, 0) for p in plan.protected)
        packed_dead = max(0, plan.packed_bytes_kept - plan.packed_bytes_live)
        data_paths = referenced | set(plan.delete_files) | set(plan.protected) | set(plan.unknown)
        metadata = sum(size for p, size in listing.items() if p not in data_paths)
    return ReportData(
        root=store.url, job_name=newest.job_name, max_parallelism=newest.max_parallelism,
        checkpoints=tuple(rows), corrupt=tuple(corrupt), newest=newest_id, states=tuple(states),
        key_groups=tuple(groups[:TOP_KEY_GROUPS]),
        referenced_bytes=sum(listing.get(p, 0) for p in referenced), garbage_bytes=garbage,
        in_flight_bytes=in_flight, packed_dead_bytes=packed_dead, metadata_bytes=metadata,
        generated_at=(now or time.time)(), garbage_unknown=unknown,
    )


# ---------------------------------------------------------------------- SVG
_W, _H, _L, _R, _T, _B = 760, 270, 70, 20, 42, 40
_COLORS = ("#2c6fbb", "#e07b28", "#2e8b57", "#8e44ad", "#c0392b")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _ticks(top: float, n: int = 4) -> list[float]:
    return [top * i / n for i in range(n + 1)]


def line_chart(name: str, title: str, xs: Sequence[int], series: Sequence[tuple[str, Sequence[float | None]]],
               fmt: Callable[[float], str], x_label: str = "checkpoint") -> str:
    """Points joined by lines, one series per ``(label, values)`` (``None``: no value); x is
    each value's position, labelled with ``xs``."""
    values = [v for _, vs in series for v in vs if v is not None]
    top = max(values, default=0.0) or 1.0
    n = len(xs)
    pw, ph = _W - _L - _R, _H - _T - _B
    x_at = (lambda i: _L + pw / 2) if n == 1 else (lambda i: _L + pw * i / (n - 1))
    y_at = lambda v: _T + ph - ph * v / top  # noqa: E731
    out = [f'<svg class="chart" data-chart="{_e(name)}" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" '
           f'role="img" aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="{_L}" y="18" class="title">{_e(title)}</text>']
    for t in _ticks(top):
        y = y_at(t)
        out.append(f'<line x1="{_L}" x2="{_W - _R}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>'
                   f'<text x="{_L - 6}" y="{y + 4:.1f}" class="tick" text-anchor="end">{_e(fmt(t))}</text>')
    step = max(1, n // 12)
    for i in range(0, n, step):
        out.append(f'<text x="{x_at(i):.1f}" y="{_H - _B + 16}" class="tick" text-anchor="middle">{_e(xs[i])}</text>')
    out.append(f'<text x="{_L + pw / 2:.1f}" y="{_H - 6}" class="tick" text-anchor="middle">{_e(x_label)}</text>')
    for k, (label, vs) in enumerate(series):
        color = _COLORS[k % len(_COLORS)]
        pts = [(x_at(i), y_at(v), xs[i], v) for i, v in enumerate(vs) if v is not None]
        if len(pts) > 1:
            out.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" data-series="{_e(label)}" points="'
                       + " ".join(f"{x:.1f},{y:.1f}" for x, y, _, _ in pts) + '"/>')
        for x, y, xid, v in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{color}" class="point" data-series="{_e(label)}" '
                       f'data-x="{_e(xid)}" data-value="{v!r}"><title>{_e(label)} at {x_label} {_e(xid)}: '
                       f'{_e(fmt(v))}</title></circle>')
        lx = _L + 170 * k  # legend: a line under the title
        out.append(f'<rect x="{lx}" y="24" width="10" height="10" fill="{color}"/>'
                   f'<text x="{lx + 14}" y="33" class="tick">{_e(label)}</text>')
    out.append("</svg>")
    return "".join(out)


def bar_chart(name: str, title: str, bars: Sequence[tuple[str, float]], fmt: Callable[[float], str]) -> str:
    """Horizontal bars, one per ``(label, value)``, largest scale first."""
    row, left, t = 22, 230, 28
    height = t + row * max(1, len(bars)) + 10
    top = max((v for _, v in bars), default=0.0) or 1.0
    width = _W - left - 110
    out = [f'<svg class="chart" data-chart="{_e(name)}" viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" '
           f'role="img" aria-label="{_e(title)}" xmlns="http://www.w3.org/2000/svg">',
           f'<text x="10" y="18" class="title">{_e(title)}</text>']
    for i, (label, v) in enumerate(bars):
        y = t + i * row
        w = max(1.0, width * v / top) if v > 0 else 0.0
        out.append(f'<text x="{left - 8}" y="{y + 14}" class="tick" text-anchor="end">{_e(label)}</text>'
                   f'<rect x="{left}" y="{y + 3}" width="{w:.1f}" height="{row - 6}" fill="{_COLORS[i % 2]}" class="bar" '
                   f'data-label="{_e(label)}" data-value="{v!r}"><title>{_e(label)}: {_e(fmt(v))}</title></rect>'
                   f'<text x="{left + w + 6:.1f}" y="{y + 14}" class="tick">{_e(fmt(v))}</text>')
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------- page
_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0 auto;max-width:1000px;padding:16px 20px;color:#1d232a}
h1{font-size:21px;margin:0 0 4px}h2{font-size:16px;margin:26px 0 8px;border-bottom:1px solid #dde1e6;padding-bottom:4px}
.muted{color:#6c7a89}.warn{color:#c0392b}
.kpis{display:flex;gap:30px;flex-wrap:wrap;margin:14px 0}.kpi b{display:block;font-size:20px}
table{border-collapse:collapse;font-variant-numeric:tabular-nums}th,td{padding:3px 10px;border-bottom:1px solid #eef0f2;text-align:right}
th:first-child,td:first-child{text-align:left}
svg.chart{display:block;margin:8px 0;max-width:100%;height:auto}
svg .title{font-weight:600;font-size:13px}svg .tick{font-size:11px;fill:#4a5560}svg .grid{stroke:#e3e6ea}
"""


def _secs(v: float | None) -> str:
    return "-" if v is None else human_seconds(v)


def _iso(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def render_report(d: ReportData) -> str:
    """The report page of ``d`` (one HTML document, no script, no external resource)."""
    cps = d.checkpoints
    ids = [c.checkpoint_id for c in cps]
    newest = next(c for c in cps if c.checkpoint_id == d.newest)
    kpis = [("checkpoints", len(cps)), ("newest", d.newest), ("full size (newest)", human_bytes(newest.full_size)),
            ("retained bytes", human_bytes(d.referenced_bytes)),
            ("garbage bytes", "unknown" if d.garbage_bytes is None else human_bytes(d.garbage_bytes)),
            ("corrupt manifests", len(d.corrupt))]
    parts = [
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">",
        f"<title>abs report · {_e(d.job_name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Checkpoints of job {_e(d.job_name)}</h1>",
        f"<div class=\"muted\">{_e(d.root)} · max parallelism {d.max_parallelism} · report of {_e(_iso(d.generated_at))}"
        f" · checkpoints {ids[0]}–{ids[-1]}</div>",
        "<div class=\"kpis\" id=\"kpis\">" + "".join(f"<div class=\"kpi\" data-kpi=\"{_e(k)}\"><b>{_e(v)}</b>{_e(k)}</div>"
                                                    for k, v in kpis) + "</div>",
    ]
    if d.corrupt:
        parts.append("<p class=\"warn\" id=\"corrupt\">" + "<br>".join(
            f"checkpoint {cid}: manifest does not read ({_e(why)}); it is not a checkpoint and is left out"
            for cid, why in d.corrupt) + "</p>")
    parts.append("<h2>Checkpoints over time</h2>")
    parts.append(line_chart("duration", "Duration and alignment (trigger to commit; longest task alignment)", ids,
                            [("duration", [c.duration_s for c in cps]), ("alignment", [c.alignment_s for c in cps])],
                            human_seconds))
    parts.append(line_chart("bytes", "Bytes written (the increment) and full size", ids,
                            [("written", [c.bytes_written for c in cps]), ("full size", [c.full_size for c in cps])],
                            human_bytes))
    parts.append(line_chart("chains", "Longest chain and space amplification", ids,
                            [("max chain length", [c.max_chain_length for c in cps]),
                             ("space amplification", [c.space_amplification for c in cps])],
                            lambda v: f"{v:.2f}".rstrip("0").rstrip(".")))
    parts.append(f"<h2>State of checkpoint {d.newest}</h2>")
    if d.states:
        parts.append("<table id=\"states\"><thead><tr><th>operator / state</th><th>key groups</th><th>max chain</th>"
                     "<th>mean chain</th><th>bases</th><th>deltas</th><th>space amplification</th></tr></thead><tbody>")
        for s in d.states:
            amp = "-" if s.space_amplification is None else f"{s.space_amplification:.2f}"
            parts.append(f"<tr><td>{_e(s.operator)}/{_e(s.state)}</td><td>{s.key_groups}</td><td>{s.max_chain_length}</td>"
                         f"<td>{s.mean_chain_length:.2f}</td><td>{human_bytes(s.base_bytes)}</td>"
                         f"<td>{human_bytes(s.delta_bytes)}</td><td>{amp}</td></tr>")
        parts.append("</tbody></table>")
        parts.append(bar_chart("amplification", "Space amplification per state ((bases + deltas) / bases)",
                               [(f"{s.operator}/{s.state}", s.space_amplification or 0.0) for s in d.states],
                               lambda v: f"{v:.2f}"))
        parts.append(bar_chart("key-groups", f"Largest {len(d.key_groups)} key groups (bytes of their chains)",
                               list(d.key_groups), human_bytes))
    else:
        parts.append("<p class=\"muted\">no keyed state</p>")
    parts.append("<h2>Retained vs garbage</h2>")
    space = [("referenced by checkpoints", d.referenced_bytes), ("garbage (gc deletes it)", d.garbage_bytes),
             ("unreferenced, newer (in flight?)", d.in_flight_bytes),
             ("dead ranges of packed files", d.packed_dead_bytes), ("manifests and metadata", d.metadata_bytes)]
    parts.append(bar_chart("space", "Bytes in the root", [(k, v) for k, v in space if v is not None], human_bytes))
    if d.garbage_unknown is not None:
        parts.append(f"<p class=\"warn\" id=\"garbage-unknown\">Garbage not counted: {_e(d.garbage_unknown)}.</p>")
    parts.append("<p class=\"muted\">Garbage: files no manifest references, older than the newest checkpoint "
                 "(<code>abs-snapshot gc</code> deletes them). Newer unreferenced files belong to a checkpoint in "
                 "flight or to an attempt that failed.</p>")
    parts.append("<h2>Every checkpoint</h2><table id=\"checkpoints\"><thead><tr><th>id</th><th>kind</th><th>created</th>"
                 "<th>duration</th><th>alignment</th><th>written</th><th>full size</th><th>files</th><th>max chain</th>"
                 "<th>amplification</th></tr></thead><tbody>")
    for c in reversed(cps):
        amp = "-" if c.space_amplification is None else f"{c.space_amplification:.2f}"
        parts.append(f"<tr data-id=\"{c.checkpoint_id}\"><td>{c.checkpoint_id}</td><td>{_e(c.kind)}</td>"
                     f"<td>{_e(_iso(c.created_at))}</td><td>{_secs(c.duration_s)}</td><td>{_secs(c.alignment_s)}</td>"
                     f"<td data-bytes=\"{c.bytes_written}\">{human_bytes(c.bytes_written)}</td>"
                     f"<td data-bytes=\"{c.full_size}\">{human_bytes(c.full_size)}</td><td>{c.files}</td>"
                     f"<td>{c.max_chain_length}</td><td>{amp}</td></tr>")
    parts.append("</tbody></table></body></html>")
    return "\n".join(parts)
