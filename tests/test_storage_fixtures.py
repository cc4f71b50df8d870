"""Roots written by older versions of the code, kept in tests/fixtures, still restore.

Each ``tests/fixtures/format-N`` was written by ``tests/fixtures/make_format_root.py`` with the
code of format N: packed bases, packed and single deltas with deletes, values images. The
code of today must verify it, resolve every key group to what that code resolved
(``expected.json``), let the documented pyarrow example read it, and continue it.
"""
from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shutil

import pyarrow as pa
import pytest

from storage import CompactionPolicy, Manifest, SnapshotStore

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
FORMAT_MD = pathlib.Path(__file__).resolve().parents[1] / "storage" / "FORMAT.md"
ROOTS = sorted(p.name for p in FIXTURES.glob("format-*"))


def rows(table: pa.Table) -> list[dict]:
    return sorted(table.to_pylist(), key=lambda r: r["key"])


@pytest.fixture(params=ROOTS)
def root(request, tmp_path) -> pathlib.Path:
    dest = tmp_path / request.param
    shutil.copytree(FIXTURES / request.param, dest)
    return dest


def test_there_are_fixtures_of_formats_5_to_8():
    assert {"format-5", "format-6", "format-7", "format-8"} <= set(ROOTS)


def test_an_old_root_verifies_and_resolves_as_its_writer_resolved_it(root):
    expected = json.loads((root / "expected.json").read_text())
    store = SnapshotStore.open(str(root))
    assert store.verify().ok
    m2 = store.read_manifest(2)
    for state, by_kg in expected.items():
        assert sorted(map(str, m2.chains("count", state))) == sorted(by_kg)
        for kg, want in by_kg.items():
            assert rows(store.read_key_group(m2, "count", state, int(kg))) == want
            assert rows(pa.Table.from_batches(list(store.iter_key_group(m2, "count", state, int(kg))))) == want


def test_the_documented_example_reads_an_old_root(root):
    expected = json.loads((root / "expected.json").read_text())
    code = re.search(r"```python\n(.*?)```", FORMAT_MD.read_text(), re.S).group(1)
    for state, kg in [("n", "0"), ("n", "7"), ("v", "1"), ("v", "5")]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace("/data/ckpt", str(root)).replace("chk-00000042", "chk-00000002")  # noqa: S102
                 .replace('"count", "n", 37', f'"count", "{state}", {kg}'), {})
        assert out.getvalue().strip() == str(expected[state][kg])


def test_an_old_root_is_continued_by_todays_writer(root):
    expected = json.loads((root / "expected.json").read_text())
    store = SnapshotStore.open(str(root), policy=CompactionPolicy(max_delta_ratio=100.0))
    store.init_job({"job_name": "fx", "max_parallelism": 8})
    m2 = store.read_manifest(2)
    chains = {state: dict(m2.chains("count", state)) for state in ("n", "v")}
    meta = store.read_key_group(m2, "count", "n", 0).schema.metadata
    writes = []
    for kg in range(8):
        key = expected["n"][str(kg)][0]["key"]
        writes.append((kg, pa.table({"key": [key], "value": pa.array([-kg], pa.int64())}).replace_schema_metadata(meta)))
    new = store.write_key_groups(3, [("count", "n", kg, chains["n"][kg], t) for kg, t in writes])
    chains["n"].update({kg: chain for (kg, _), chain in zip(writes, new)})
    m3 = store.commit(Manifest(checkpoint_id=3, job_name="fx", max_parallelism=8, keyed={"count": chains}))
    again = SnapshotStore.open(str(root))
    assert again.verify().ok
    for kg in range(8):
        want = [dict(r, value=-kg) if i == 0 else r for i, r in enumerate(expected["n"][str(kg)])]
        assert rows(again.read_key_group(m3, "count", "n", kg)) == want
        assert rows(again.read_key_group(m3, "count", "v", kg)) == expected["v"][str(kg)]
