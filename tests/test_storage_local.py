"""A local root without fsspec: ``RootIO`` over plain ``os`` calls behaves as over fsspec's
local file system, and a store opened on a local path does not import fsspec."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import fsspec.core
import pytest
from fsspec.implementations.local import LocalFileSystem

from storage import SnapshotStore
from storage.backend import RootIO
from storage.store_root import local_root


@pytest.mark.parametrize("url", ["{tmp}/root", "{tmp}/root/", "file://{tmp}/root", "root", "./root", "root/sub/", "."])
def test_a_local_url_resolves_to_the_path_fsspec_gives_it(tmp_path, monkeypatch, url):
    monkeypatch.chdir(tmp_path)
    url = url.format(tmp=tmp_path)
    _, expected = fsspec.core.url_to_fs(url)
    assert local_root(url) == expected


def test_a_home_relative_path_is_expanded_as_fsspec_does():
    _, expected = fsspec.core.url_to_fs("~/abs-root")
    assert local_root("~/abs-root") == expected


@pytest.mark.parametrize("url", ["memory://root", "s3://bucket/prefix", "local://x", "simplecache::file:///tmp/x"])
def test_other_urls_go_through_fsspec(url):
    assert local_root(url) is None


def _both(tmp_path) -> tuple[RootIO, RootIO]:
    root = str(tmp_path / "root")
    return RootIO(None, root, root), RootIO(LocalFileSystem(), root, root)


def test_plain_os_calls_do_what_fsspec_does(tmp_path):
    plain, through_fsspec = _both(tmp_path)
    assert plain.list() == through_fsspec.list() == {}
    assert plain.list("checkpoints") == through_fsspec.list("checkpoints") == {}
    plain.put("state/a/1.arrow", b"one")
    plain.put("state/b/c/2.arrow", b"second")
    plain.put_new("checkpoints/chk-1.json", b"{}", "checkpoints/.tmp-1")
    with pytest.raises(FileExistsError):
        plain.put_new("checkpoints/chk-1.json", b"{}", "checkpoints/.tmp-2")
    expected = {"checkpoints/chk-1.json": 2, "state/a/1.arrow": 3, "state/b/c/2.arrow": 6}
    assert plain.list() == through_fsspec.list() == expected
    assert list(plain.list()) == list(through_fsspec.list())  # the same order too
    assert plain.list("state") == through_fsspec.list("state")
    assert plain.list("state/a/1.arrow") == through_fsspec.list("state/a/1.arrow") == {"state/a/1.arrow": 3}
    assert plain.exists("state/a/1.arrow") and through_fsspec.exists("state/a/1.arrow")
    assert plain.get("state/b/c/2.arrow") == b"second"
    assert plain.delete("state/a/1.arrow") is True
    assert plain.delete("state/a/1.arrow") is False
    assert not plain.exists("state/a/1.arrow") and not through_fsspec.exists("state/a/1.arrow")
    assert isinstance(plain.fs, LocalFileSystem)  # made on first use, for callers that want one
    assert not plain.object_store


def test_a_store_on_a_local_path_works_without_fsspec(tmp_path):
    # a fresh interpreter where importing fsspec fails: a local root must not need it
    script = textwrap.dedent(
        f"""
        import json, sys
        sys.modules["fsspec"] = None
        import pyarrow as pa
        from storage import SnapshotStore
        store = SnapshotStore.open({str(tmp_path / "root")!r})
        store.write_probe()
        store.write_operator_state(1, "op", 0, pa.table({{"a": [1, 2]}}))
        print(json.dumps({{"files": sorted(store.list_files()), "exists": store.exists()}}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["files"] and seen["exists"] is False  # a file, but no manifest nor job record yet
    assert SnapshotStore.open(str(tmp_path / "root")).list_files() == {f: os.path.getsize(tmp_path / "root" / f)
                                                                         for f in seen["files"]}
