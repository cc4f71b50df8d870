"""The path builder: golden layout, reversible name encoding, strict validation, layering."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage import FileRef, InvalidPathError, StoragePaths, decode_name, encode_name
from storage.paths import validate_relative_path

T = "0123456789abcdef" * 2


def test_paths_follow_the_documented_layout():
    assert StoragePaths.JOB == "_job.json"
    assert StoragePaths.manifest(42) == "checkpoints/chk-00000042.json"
    assert StoragePaths.state_file(42, "count", "n", 37, "delta", T) == f"state/count/n/kg-0037/00000042-delta-{T}.arrow"
    assert StoragePaths.state_file(40, "count", "n", 37, "base", T) == f"state/count/n/kg-0037/00000040-base-{T}.arrow"
    assert StoragePaths.opstate_file(42, "src", 3, T) == f"opstate/src/00000042-3-{T}.arrow"
    assert StoragePaths.channel_file(42, "head#1", T) == f"channels/00000042/head%231-{T}.arrow"
    assert StoragePaths.manifest(123_456_789) == "checkpoints/chk-123456789.json"
    assert StoragePaths.key_group_dir("o", "s", 32767) == "state/o/s/kg-32767"


def test_parse_inverts_every_builder():
    p = StoragePaths.parse(StoragePaths.state_file(42, "a/b c", "st.1", 5, "delta", T))
    assert (p.category, p.checkpoint_id, p.operator, p.state, p.key_group) == ("delta", 42, "a/b c", "st.1", 5)
    p = StoragePaths.parse(StoragePaths.opstate_file(7, "src-1", 12, T))
    assert (p.category, p.checkpoint_id, p.operator, p.subtask) == ("opstate", 7, "src-1", 12)
    p = StoragePaths.parse(StoragePaths.channel_file(9, "head-0", T))
    assert (p.category, p.checkpoint_id, p.task) == ("channel", 9, "head-0")
    assert StoragePaths.parse(StoragePaths.manifest_temp(3, T)).category == "manifest_tmp"
    assert StoragePaths.parse("checkpoints/chk-1.json") is None  # not zero-padded: not ours
    assert StoragePaths.parse("state/o/s/kg-0001/00000001-base-xyz.arrow") is None
    assert StoragePaths.parse("savepoints/sp-00000001/_job.json") is None


SAFE_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-"


@given(st.text(min_size=1, max_size=60))
def test_name_encoding_is_reversible_and_path_safe(name):
    escaped = sum(1 if chr(b) in SAFE_CHARS and not (i == 0 and b == ord(".")) else 3
                  for i, b in enumerate(name.encode()))
    if escaped > 255:  # e.g. 22 four-byte characters: 264 characters once %-escaped
        with pytest.raises(InvalidPathError, match="more than the 255"):
            encode_name(name)
        return
    segment = encode_name(name)
    assert decode_name(segment) == name
    assert "/" not in segment and segment not in (".", "..") and not segment.startswith(".")
    assert set(segment) <= set(SAFE_CHARS + "%")


@pytest.mark.parametrize("name, encoded", [
    ("count", "count"), ("..", "%2E."), (".hidden", "%2Ehidden"), ("a/b", "a%2Fb"), ("ä", "%C3%A4"),
    ("100%", "100%25"), ("a b", "a%20b"),
])
def test_name_encoding_golden_values(name, encoded):
    assert encode_name(name) == encoded


def test_non_canonical_or_empty_names_are_refused():
    with pytest.raises(InvalidPathError):
        encode_name("")
    with pytest.raises(InvalidPathError):
        decode_name("a%2fb")  # lower-case hex is not what we write
    with pytest.raises(InvalidPathError, match="segment may have"):
        encode_name("/" * 100)


@pytest.mark.parametrize("path", ["", "/abs/x", "a/../b", "./a", "a//b", "a\\b", "s3://b/k", "C:/x", "a/.", "a/\x00"])
def test_unsafe_relative_paths_are_refused(path):
    with pytest.raises(InvalidPathError):
        validate_relative_path(path)


def test_file_refs_must_name_a_file_of_their_kind_and_checkpoint():
    path = StoragePaths.state_file(4, "o", "s", 0, "base", T)
    FileRef(path=path, kind="base", checkpoint_id=4, rows=1, bytes=1, checksum="a" * 64)
    with pytest.raises(InvalidPathError, match="does not denote a delta file of checkpoint 4"):
        FileRef(path=path, kind="delta", checkpoint_id=4, rows=1, bytes=1, checksum="a" * 64)
    with pytest.raises(InvalidPathError, match="checkpoint 5"):
        FileRef(path=path, kind="base", checkpoint_id=5, rows=1, bytes=1, checksum="a" * 64)
    with pytest.raises(InvalidPathError, match="checksum"):
        FileRef(path=path, kind="base", checkpoint_id=4, rows=1, bytes=1, checksum="md5:abc")


STORAGE = pathlib.Path(__file__).resolve().parents[1] / "storage"


def test_storage_never_imports_the_runtime_or_recovery():
    for source in STORAGE.glob("*.py"):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            for name in names:
                assert name.split(".")[0] not in ("abs", "recovery"), f"{source.name} imports {name}"
    code = "import sys, storage, storage.testing, storage.inspect; " \
           "bad = [m for m in sys.modules if m.split('.')[0] in ('abs', 'recovery')]; assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=STORAGE.parent)


def test_only_the_path_builder_formats_checkpoint_ids():
    for source in STORAGE.glob("*.py"):
        if source.name in ("paths.py",):
            continue
        text = source.read_text()
        assert ":08d}" not in text and "kg-{" not in text, f"{source.name} formats a storage path by hand"
