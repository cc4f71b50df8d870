"""Format 7's reference tables: a manifest names each file and each range once, references are
short arrays of indexes into them, malformed ones are corrupt manifests with a one-line error,
and a small delta's checkpoint is no longer dominated by its manifest (issue 23, target 5)."""
from __future__ import annotations

import dataclasses
import json
import pathlib

import pyarrow as pa
import pytest

import storage.manifest_refs
from storage import CorruptManifestError, FileRef, Manifest, SnapshotStore, StoragePaths
from storage.manifest_json import layout_json
from storage.manifest_refs import RANGE_FIELDS
from storage.store import KeyGroupWrite

OP, M = "count", 16
META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}
SOURCE = "checkpoints/chk-00000007.json"


def _ck(c: str) -> str:
    return c * 32


def refs() -> dict[str, FileRef]:
    """One reference of every shape: a file of its own, a key group's stream of a packed file, two
    key groups' rows of one shared range, operator state, a channel log."""
    packed = StoragePaths.packed_file(6, OP, "n", token=_ck("1"))
    shared = dict(path=packed, kind="delta", checkpoint_id=6, checksum=_ck("c"), checksum_algorithm="xxh3_128",
                  offset=700, range_rows=10, range_bytes=90)
    return {
        "own": FileRef(path=StoragePaths.state_file(5, OP, "n", 1, "base", token=_ck("2")), kind="base", checkpoint_id=5, rows=4,
                       bytes=300, checksum=_ck("a"), checksum_algorithm="xxh3_128"),
        "stream": FileRef(path=packed, kind="base", checkpoint_id=6, rows=7, bytes=700, checksum=_ck("b"),
                          checksum_algorithm="xxh3_128", offset=0, key_group=2),
        "part2": FileRef(**shared, rows=3, bytes=27, key_group=2, row_offset=0),
        "part3": FileRef(**shared, rows=7, bytes=63, key_group=3, row_offset=3),
        "opstate": FileRef(path=StoragePaths.opstate_file(6, "src", 0, token=_ck("3")), kind="opstate", checkpoint_id=6, rows=1,
                           bytes=100, checksum=_ck("d"), checksum_algorithm="xxh3_128"),
        "channel": FileRef(path=StoragePaths.channel_file(6, "count#0", token=_ck("4")), kind="channel", checkpoint_id=6, rows=2,
                           bytes=200, checksum=_ck("e"), checksum_algorithm="xxh3_128"),
    }


def manifest(**kw) -> Manifest:
    r = refs()
    return Manifest(checkpoint_id=7, job_name="j", max_parallelism=M,
                    keyed={OP: {"n": {1: [r["own"]], 2: [r["stream"], r["part2"]], 3: [r["part3"]]}}},
                    operator_state={"src": {0: r["opstate"]}}, operator_state_rules={"src": "split"},
                    channel_logs=[r["channel"]], **kw)


def test_every_file_and_range_is_named_once_and_references_index_them():
    m = manifest()
    doc = json.loads(m.to_json())
    r = refs()
    assert doc["files"] == [r["own"].path, r["stream"].path, r["opstate"].path, r["channel"].path]
    assert doc["ranges"] == [
        [0, "base", 0, 300, 4, "xxh3_128", _ck("a")],
        [1, "base", 0, 700, 7, "xxh3_128", _ck("b")],
        [1, "delta", 700, 90, 10, "xxh3_128", _ck("c")],  # the shared range: once, for both key groups
        [2, "opstate", 0, 100, 1, "xxh3_128", _ck("d")],
        [3, "channel", 0, 200, 2, "xxh3_128", _ck("e")],
    ]
    assert doc["keyed"][OP]["n"] == {"1": [[0]], "2": [[1], [2, 0, 3]], "3": [[2, 3, 7]]}
    assert doc["operator_state"] == {"src": {"0": [3]}} and doc["channel_logs"] == [[4]]
    back = Manifest.from_json(m.to_json(), source=SOURCE)
    assert back == m and back.files() == m.files() and back.paths() == m.paths()
    assert back.keyed[OP]["n"][3][0].bytes == 63 and back.keyed[OP]["n"][3][0].range_bytes == 90


def test_the_manifest_is_laid_out_one_line_per_file_range_and_chain():
    text = manifest().to_json()
    lines = [line.strip().rstrip(",") for line in text.splitlines()]
    doc = json.loads(text)
    assert all(json.dumps(item, separators=(",", ":")) in lines for item in doc["files"] + doc["ranges"])
    assert '"keyed": {"count":{"n":{"1":[[0]],"2":[[1],[2,0,3]],"3":[[2,3,7]]}}}' in lines  # short: one line
    many = manifest(stats={"note": "x" * 200})
    many.keyed[OP]["n"].update({kg: [many.keyed[OP]["n"][1][0]] for kg in range(4, 16)})  # longer: a line a chain
    lines = [line.strip().rstrip(",") for line in many.to_json().splitlines()]
    assert '"2": [[1],[2,0,3]]' in lines and '"15": [[0]]' in lines


@pytest.mark.parametrize("doc", [
    {"r": [[i, "s"] for i in range(40)] + [[1, "x],[y"]] * 30},  # a string that looks like an item boundary
    {"r": [[[1]], [2]] * 50, "e": [[]] * 80, "m": [[1, 2]] + [[3]] * 60},
    {2: "a" * 120, True: [None, 1.5, "\u00e9\n"] * 40, None: {}, "deep": [[[["x" * 30] * 5] * 3] * 2]},
])
def test_the_layout_is_json_of_the_same_document(doc):
    text = layout_json(doc)
    assert json.loads(text) == json.loads(json.dumps(doc)) and all(len(line) < 200 for line in text.splitlines())


def test_an_older_manifest_keeps_its_own_form_and_checksum():
    old = dataclasses.replace(manifest(), format_version=6)
    doc = json.loads(old.to_json())
    assert "files" not in doc and "ranges" not in doc and doc["keyed"][OP]["n"]["3"][0]["row_offset"] == 3
    assert Manifest.from_json(old.to_json()) == old


def _doc() -> dict:
    doc = manifest().to_dict()  # no checksum: the references themselves are what is tested
    return doc


@pytest.mark.parametrize("mutate,message", [
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, [9]), "range 9 is not an index into ranges"),
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, [-1]), "range -1 is not an index"),
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, [True]), "range True is not an index"),
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, [0, 1]), r"is not \[range\] or \[range, row_offset, rows\]"),
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, {"path": "x"}), r"is not \[range\] or"),
    (lambda d: d["keyed"][OP]["n"]["1"].__setitem__(0, [0, 0, 1]), "a file of its own"),
    (lambda d: d["keyed"][OP]["n"]["3"].__setitem__(0, [2, 8, 7]), r"rows \[8, 15\) end past the 10 rows"),
    (lambda d: d["keyed"][OP]["n"]["3"].__setitem__(0, [2, -1, 7]), "row_offset -1 is not an integer"),
    (lambda d: d["keyed"][OP]["n"]["3"].__setitem__(0, [2, 0, 2 ** 64]), "rows 18446744073709551616"),
    (lambda d: d["operator_state"]["src"].__setitem__("0", [1]), "only chains of keyed state"),
    (lambda d: d["channel_logs"].__setitem__(0, [2, 0, 1]), "only chains of keyed state"),
    (lambda d: d["ranges"][0].__setitem__(2, 64), "offset 64 in .*a file of its own"),
    (lambda d: d["ranges"][0].__setitem__(0, 7), "file 7 is not an index into files"),
    (lambda d: d["ranges"][0].pop(), "is not an array of 7 fields"),
    (lambda d: d["ranges"][0].__setitem__(3, 2 ** 63), r"bytes=9223372036854775808 is not an integer"),
    (lambda d: d["ranges"][0].__setitem__(1, "opstate"), "does not denote"),
    (lambda d: d["ranges"][0].__setitem__(6, "zz"), "is not a xxh3_128 hex digest"),
    (lambda d: d["files"].__setitem__(0, "../outside/x.arrow"), "outside the root|'..' segment"),
    (lambda d: d["files"].__setitem__(0, 5), "files is not a list of paths"),
    (lambda d: d["files"].__setitem__(0, "state/x.arrow"), "is not the path of a file this format writes"),
    (lambda d: d.pop("ranges"), "lacks field 'ranges'"),
    (lambda d: d.update(ranges={}), "ranges is not a list"),
])
def test_a_malformed_reference_table_or_entry_is_a_corrupt_manifest(mutate, message):
    doc = _doc()
    Manifest.from_dict(doc)  # intact: reads
    mutate(doc)
    with pytest.raises(CorruptManifestError, match=message) as err:
        Manifest.from_json(json.dumps(doc), source=SOURCE)
    assert str(err.value).startswith(SOURCE) and "\n" not in str(err.value) and len(str(err.value)) < 600


def test_more_references_than_a_manifest_may_hold_are_refused_before_they_expand(monkeypatch):
    monkeypatch.setattr(storage.manifest_refs, "MAX_REFERENCES", 6)
    doc = _doc()
    Manifest.from_dict(doc)  # 6 references: the limit
    doc["keyed"][OP]["n"]["4"] = [[0]]
    with pytest.raises(CorruptManifestError, match="more than 6 references"):
        Manifest.from_dict(doc, source=SOURCE)
    doc = _doc()
    doc["ranges"] += [doc["ranges"][0]] * 2
    with pytest.raises(CorruptManifestError, match="ranges has 7 entries, more than the 6"):
        Manifest.from_dict(doc, source=SOURCE)


def test_references_that_disagree_about_their_range_are_refused_when_encoded():
    m = manifest()
    other = dataclasses.replace(m.keyed[OP]["n"][3][0], checksum=_ck("f"))
    with pytest.raises(CorruptManifestError, match="disagree about its kind, size, rows or checksum.*refusing to commit"):
        dataclasses.replace(m, keyed={OP: {"n": {**m.keyed[OP]["n"], 3: [other]}}}).to_json()
    uneven = dataclasses.replace(m.keyed[OP]["n"][3][0], bytes=60)  # not its share of the range
    with pytest.raises(CorruptManifestError, match="is not the key group's share"):
        dataclasses.replace(m, keyed={OP: {"n": {**m.keyed[OP]["n"], 3: [uneven]}}}).to_json()


def test_a_one_percent_delta_commits_a_manifest_of_a_few_bytes_per_reference(tmp_path):
    """Target 5 counts what a checkpoint writes, its manifest included: 1 % of 6,400 string keys
    in 128 key groups change; the manifest holds 256 references of 128 chains, 2 files and a
    range per stream, and costs less than 48 bytes a reference (format 6: ~400)."""
    kgs = 128
    store = SnapshotStore.open(str(tmp_path))
    store.init_job({"job_name": "j", "max_parallelism": kgs})

    def table(kg: int, n: int, bump: int) -> pa.Table:
        keys = [f"k{kg}-{i}" for i in range(n)]
        return pa.table({"key": keys, "value": pa.array([i + bump for i in range(n)], pa.int64())}).replace_schema_metadata(META)

    chains = dict(enumerate(store.write_key_groups(1, [
        KeyGroupWrite(OP, "n", kg, [], table(kg, 50, 0), complete=True) for kg in range(kgs)])))
    store.commit(Manifest(checkpoint_id=1, job_name="j", max_parallelism=kgs, keyed={OP: {"n": dict(chains)}}))
    new = store.write_key_groups(2, [KeyGroupWrite(OP, "n", kg, chains[kg], table(kg, 1, 1)) for kg in range(kgs)])
    chains.update(enumerate(new))
    m2 = store.commit(Manifest(checkpoint_id=2, job_name="j", max_parallelism=kgs, keyed={OP: {"n": dict(chains)}}))
    text = (tmp_path / StoragePaths.manifest(2)).read_text()
    doc = json.loads(text)
    refs_n = sum(len(c) for c in doc["keyed"][OP]["n"].values())
    assert refs_n == 2 * kgs and len(doc["files"]) == 2 and len(doc["ranges"]) == len({r.range_id for r in m2.iter_refs()})
    assert len(text) - len(json.dumps(doc["stats"], indent=1)) < 48 * refs_n + 120 * len(doc["ranges"]) + 600
    fresh = SnapshotStore.open(str(tmp_path))
    assert fresh.verify().ok
    assert fresh.read_key_group(fresh.read_manifest(2), OP, "n", 5).to_pylist()[0]["value"] == 1


def test_the_range_fields_are_those_format_md_documents():
    md = " ".join((pathlib.Path(__file__).resolve().parents[1] / "storage" / "FORMAT.md").read_text().split())
    assert "`[" + ", ".join(RANGE_FIELDS) + "]`" in md


def _chains(n: int, **special) -> dict:
    out = {str(kg): [[kg % 7, kg, 3]] for kg in range(n)}
    out.update(special)
    return out


@pytest.mark.parametrize("chains,at_once", [
    (_chains(500), True),
    (_chains(300, **{"7": [[1]] * 2, "8": [], "9": [[-1, 10 ** 20]], "10": [[2], [3, 0, 1], [4]]}), True),
    (_chains(300, **{"7": [[i, i, i] for i in range(40)]}), False),  # a chain too long for one line
    (_chains(300, **{"7": [[1, "a"]]}), False),  # a string among the numbers
    (_chains(300, **{"x7": [[1]]}), False),  # a key that is not a key group
    (_chains(300, **{"7": [[1.5]]}), False),
    (_chains(300, **{"7": [[True]]}), False),
    (_chains(300, **{"7": {"a": [1]}}), False),
])
def test_the_chains_of_many_key_groups_are_laid_out_at_once_as_item_by_item(monkeypatch, chains, at_once):
    """A state's chains by key group (thousands at a large max_parallelism) are laid out from
    one encoding of them: the same text as item by item, one line per key group."""
    from storage import manifest_json

    doc = {"format_version": 8, "keyed": {OP: {"n": chains}}, "stats": {"a": 1}}
    real = manifest_json._layout_chains
    used: list = []
    monkeypatch.setattr(manifest_json, "_layout_chains", lambda *a: used.append(real(*a)) or used[-1])
    fast = layout_json(doc)
    assert any(u is not None for u in used) == at_once
    monkeypatch.setattr(manifest_json, "_layout_chains", lambda *a: None)
    assert fast == layout_json(doc) and json.loads(fast) == doc


def _ref(kind: str, cid: int, kg: int | None, packed: bool = True, op: str = OP, state: str = "n") -> FileRef:
    if packed:
        whole = FileRef(path=StoragePaths.packed_file(cid, op, state), kind=kind, checkpoint_id=cid, rows=10,
                        bytes=100, checksum="0" * 32, checksum_algorithm="xxh3_128", offset=cid * 100, key_group=0)
        return whole.in_range(kg)  # type: ignore[arg-type]
    return FileRef(path=StoragePaths.state_file(cid, op, state, kg, kind), kind=kind, checkpoint_id=cid,  # type: ignore[arg-type]
                   rows=1, bytes=10, checksum="0" * 32, checksum_algorithm="xxh3_128")


@pytest.mark.parametrize("chain,messages", [
    (lambda: [_ref("base", 1, 3)], []),
    (lambda: [_ref("base", 1, 3, packed=False), _ref("delta", 2, 3)], []),
    (lambda: [], ["empty chain"]),
    (lambda: [_ref("delta", 1, 3)], ["chain starts with a delta, not a base"]),
    (lambda: [_ref("base", 1, 3), _ref("base", 2, 3)], ["position 1 is a base, only deltas may follow the base"]),
    (lambda: [_ref("base", 1, 4)], ["file belongs to another operator/state/key group"]),
    (lambda: [_ref("base", 1, 4, packed=False)], ["file belongs to another operator/state/key group"]),
    (lambda: [_ref("base", 1, 3, state="other")], ["file belongs to another operator/state/key group"]),
    (lambda: [_ref("base", 2, 3), _ref("delta", 1, 3)], ["checkpoint ids go backwards along the chain"]),
    (lambda: [_ref("base", 1, 3), _ref("delta", 9, 3)], ["file of checkpoint 9 is newer than the manifest"]),
    (lambda: [_ref("base", 1, 3)] + [_ref("delta", 2, 3)] * 2, ["the same file appears twice"]),
    (lambda: [_ref("delta", 2, 3), _ref("base", 1, 4)],
     ["starts with a delta", "position 1 is a base", "belongs to another", "go backwards"]),
])
def test_chain_problems_names_each_problem_of_a_chain(chain, messages):
    from storage.manifest import chain_problems

    got = chain_problems(chain(), operator=OP, state="n", key_group=3, max_checkpoint_id=5)
    assert len(got) == len(messages) and all(m in text for m, (_p, text) in zip(messages, got))
    assert all(text.startswith(f"{OP}/n/kg 3: ") for _p, text in got)
