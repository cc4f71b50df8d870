"""The offline HTML report of a snapshot root (abs.observe.report, ``abs-snapshot report``):
its figures against the manifests, its bad-input errors, and the file in a real browser."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pytest

import abs
from abs.cli import main
from abs.observe.report import TOP_KEY_GROUPS, collect_report, render_report
from browser import browser_page
from pacing import PacedSource
from storage import SnapshotStore, StoragePaths

DOCS = Path(__file__).resolve().parent.parent / "docs"


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    """A root of several incremental checkpoints: each reader emits at most 1,300 of its
    10,000 records per completed checkpoint, so the job takes eight or more of them. 20,000
    keys: each checkpoint adds ~2,600 of them, so key groups grow by deltas on their bases.
    (With 3,000 keys a checkpoint changed more than half of every key group, which is then
    written whole as a new base: whether any checkpoint made a delta was down to timing.)"""
    path = str(tmp_path_factory.mktemp("report") / "root")
    flow = abs.Dataflow("report-counts")
    src = PacedSource(abs.GeneratorSource(20_000, num_keys=20_000, num_splits=2, batch_size=100), 1_300)
    flow.source("src", src).key_by("key").process("count", count_fn, state=[abs.ValueState("n", pa.int64())]) \
        .sink("out", abs.CollectSink())
    result = abs.run(flow, parallelism=2, storage=path, checkpoint=abs.CheckpointConfig(interval=0.05, retained=50))
    assert len(result.completed_checkpoints) >= 8
    return path


def test_the_report_figures_are_the_manifests(root):
    store = SnapshotStore.open(root)
    data = collect_report(store)
    ids = store.list_checkpoints()
    assert [c.checkpoint_id for c in data.checkpoints] == ids and data.newest == ids[-1] and not data.corrupt
    for row in data.checkpoints:
        stats = store.read_manifest(row.checkpoint_id).stats
        assert (row.bytes_written, row.full_size, row.files, row.max_chain_length) == \
            (stats["bytes_written"], stats["full_size"], stats["files"], stats["max_chain_length"])
        assert row.duration_s == stats["duration_s"] and row.alignment_s == stats["alignment_s"]
    newest = store.read_manifest(ids[-1])
    (state,) = data.states
    chains = newest.keyed["count"]["n"]
    assert (state.operator, state.state, state.key_groups) == ("count", "n", len(chains))
    assert state.max_chain_length == max(len(c) for c in chains.values())
    assert any(store.read_manifest(cid).stats["max_chain_length"] > 1 for cid in ids)  # incremental: deltas on bases
    sizes = sorted((sum(r.bytes for r in chain) for chain in chains.values()), reverse=True)
    assert [b for _, b in data.key_groups] == sizes[:TOP_KEY_GROUPS]
    referenced = {r.path for cid in ids for r in store.read_manifest(cid).files().values()}
    assert data.referenced_bytes == sum(size for p, size in store.list_files().items() if p in referenced)
    assert data.garbage_bytes == 0


def test_the_page_is_self_contained(root):
    page = render_report(collect_report(SnapshotStore.open(root)))
    assert "<script" not in page.lower() and "<link" not in page.lower()
    assert "https://" not in page and "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    for chart in ("duration", "bytes", "chains", "amplification", "key-groups", "space"):
        assert f'data-chart="{chart}"' in page


def test_the_cli_writes_the_report_and_names_bad_roots_without_a_traceback(root, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", root, "--output", str(out)]) == 0
    assert "written to" in capsys.readouterr().out and out.read_text().startswith("<!doctype html>")

    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty), "--output", str(tmp_path / "e.html")]) == 2
    err = capsys.readouterr().err
    assert "holds no snapshots" in err and "Traceback" not in err
    assert main(["report", str(tmp_path / "missing"), "--output", str(tmp_path / "m.html")]) == 2
    assert "Traceback" not in capsys.readouterr().err

    broken = tmp_path / "broken"
    shutil.copytree(root, broken)
    ids = SnapshotStore.open(str(broken)).list_checkpoints()
    (broken / StoragePaths.manifest(ids[-1])).write_bytes(b"{not json")
    assert main(["report", str(broken), "--output", str(tmp_path / "b.html")]) == 0
    assert f"checkpoint {ids[-1]}: manifest does not read" in capsys.readouterr().err
    for cid in ids[:-1]:
        (broken / StoragePaths.manifest(cid)).write_bytes(b"\x00garbage")
    assert main(["report", str(broken), "--output", str(tmp_path / "b2.html")]) == 1
    err = capsys.readouterr().err
    assert "holds no checkpoint that reads" in err and "Traceback" not in err
    assert not (tmp_path / "b2.html").exists()

    assert main(["report", root, "--output", str(tmp_path / "no-such-dir" / "r.html")]) == 2
    assert "cannot write the report" in capsys.readouterr().err


def test_report_takes_the_output_file_as_output_and_o_as_a_storage_option_like_every_command(tmp_path, capsys):
    """-o was report's output file once; now it is a storage option as elsewhere, and -o FILE
    (no '=') is a usage error that names --output FILE, before the root is opened."""
    from abs.cli import build_parser

    args = build_parser().parse_args(["report", "s3://b/p", "--output", "r.html", "-o", "anon=true"])
    assert (args.output, args.storage_option) == ("r.html", ["anon=true"])
    out = tmp_path / "report.html"
    assert main(["report", str(tmp_path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"name the HTML file to write with --output FILE (e.g. --output {out})" in err
    assert "Traceback" not in err and err.count("\n") == 1 and not out.exists()
    assert main(["report", str(tmp_path)]) == 2
    assert "no output file; name the HTML file to write with --output FILE" in capsys.readouterr().err


def test_the_report_file_renders_its_charts_in_a_browser_with_the_manifests_numbers(root, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", root, "--output", str(out)]) == 0
    store = SnapshotStore.open(root)
    ids = store.list_checkpoints()
    with browser_page(tmp_path) as page:
        page.goto(out.as_uri())
        charts = page.locator("svg.chart")
        assert charts.count() == 6
        for i in range(charts.count()):
            chart = charts.nth(i)
            box = chart.bounding_box()
            assert box is not None and box["width"] > 300 and box["height"] > 50
            marks = chart.locator("circle.point, rect.bar")
            assert marks.count() > 0, chart.get_attribute("data-chart")
            drawn = [m.bounding_box() for m in marks.all()]
            assert any(b and b["width"] > 0 and b["height"] > 0 for b in drawn)
        durations = page.eval_on_selector_all(
            "svg[data-chart=duration] circle[data-series=duration]",
            "cs => cs.map(c => [Number(c.dataset.x), Number(c.dataset.value)])")
        assert durations == [[cid, store.read_manifest(cid).stats["duration_s"]] for cid in ids]
        full = page.eval_on_selector_all("svg[data-chart=bytes] circle[data-series='full size']",
                                         "cs => cs.map(c => Number(c.dataset.value))")
        assert full == [store.read_manifest(cid).stats["full_size"] for cid in ids]
        assert page.text_content("[data-kpi=checkpoints] b") == str(len(ids))
        assert page.locator("#checkpoints tbody tr").count() == len(ids)
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("ABS_UPDATE_SCREENSHOTS"):  # the README's picture, without this machine's path
            data = dataclasses.replace(collect_report(store), root="file:///data/snapshots/report-counts")
            (tmp_path / "readme.html").write_text(render_report(data), encoding="utf-8")
            page.goto((tmp_path / "readme.html").as_uri())
            page.screenshot(path=str(DOCS / "report.png"), full_page=True)


def test_a_manifest_of_a_newer_format_leaves_the_garbage_uncounted_not_the_report(root, tmp_path, capsys):
    """GC refuses such a root (the manifest may reference any file); the report is still
    written, says it left that checkpoint out and that it could not count the garbage."""
    newer = tmp_path / "newer"
    shutil.copytree(root, newer)
    ids = SnapshotStore.open(str(newer)).list_checkpoints()
    doc = json.loads((newer / StoragePaths.manifest(ids[-1])).read_text())
    doc.update(checkpoint_id=ids[-1] + 1, format_version=99)
    (newer / StoragePaths.manifest(ids[-1] + 1)).write_text(json.dumps(doc))
    out = tmp_path / "n.html"
    assert main(["report", str(newer), "--output", str(out)]) == 0
    captured = capsys.readouterr()
    assert f"checkpoint {ids[-1] + 1}: manifest does not read (written by a newer format" in captured.err
    assert (f"note: garbage not counted: the manifest of checkpoint {ids[-1] + 1} is of a newer storage format"
            in captured.err)
    assert "GC refused" not in captured.err and "written to" in captured.out
    page = out.read_text()
    assert 'id="garbage-unknown"' in page and 'data-label="garbage (gc deletes it)"' not in page
    assert 'data-label="referenced by checkpoints"' in page
    data = collect_report(SnapshotStore.open(str(newer)))
    assert data.newest == ids[-1] and data.garbage_bytes is None and data.garbage_unknown is not None
