"""Values images (format 4): a full image whose keys are exactly its chain base's keys is written
as the values alone, and chains holding one resolve to the model; broken ones are refused."""
from __future__ import annotations

import re
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage import CompactionPolicy, DeltaSchemaError, SnapshotStore, resolve_chain
from storage.format import META_KEYS_DIGEST, values_image
from storage.values_images import META_BYTE_STREAM_SPLIT, join_byte_streams, split_byte_streams
from storage.store import KeyGroupWrite
from storage.store_write import SHARE_BELOW, _encode

META = {b"abs.key_encoding": b"arrow", b"abs.value_encoding": b"arrow"}


def image(model: dict[int, int | None], shuffle_seed: int = 0) -> pa.Table:
    """A full image of ``model`` in a shuffled row order (a column's slots are in insertion order)."""
    keys = np.array(sorted(model), dtype=np.int64)
    np.random.default_rng(shuffle_seed).shuffle(keys)
    values = [model[int(k)] for k in keys]
    return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array(values, pa.int64())}).replace_schema_metadata(META)


def delta(changes: list[tuple[int, int | None, int]]) -> pa.Table:
    return pa.table({"key": pa.array([k for k, _, _ in changes], pa.int64()),
                     "value": pa.array([v for _, v, _ in changes], pa.int64()),
                     "op": pa.array([o for _, _, o in changes], pa.int8())}).replace_schema_metadata(META)


def as_dict(table: pa.Table) -> dict:
    return dict(zip(table.column("key").to_pylist(), table.column("value").to_pylist()))


@pytest.fixture
def store(memory_root):
    return SnapshotStore.open(memory_root)


def test_an_image_over_an_unchanged_base_writes_the_values_alone(memory_root):
    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=10.0))
    model = {k: k * 10 for k in range(0, 400, 3)}
    chain = store.write_key_group(1, "op", "n", 5, [], image(model), complete=True)
    (base,) = chain
    assert base.kind == "base" and base.rows == len(model)
    model = {k: v + 1 for k, v in model.items()}
    model[9] = None  # a null value is a value like any other
    chain = store.write_key_group(2, "op", "n", 5, chain, image(model, 1), complete=True, over_base=base)
    assert chain[0] == base and len(chain) == 2 and chain[1].kind == "delta" and chain[1].rows == len(model)
    stored = store.read_file(chain[1])
    assert stored.column_names == ["value"]  # no key column: the keys are the base's
    assert stored.schema.metadata[META_KEYS_DIGEST].startswith(base.checksum_algorithm.encode() + b":")
    assert chain[1].bytes < base.bytes
    resolved = store.read_chain(chain)
    assert as_dict(resolved) == model and resolved.schema.metadata == META
    # the next image replaces the values image: the chain stays [base, values]
    model = {k: (v or 0) * 2 for k, v in model.items()}
    chain3 = store.write_key_group(3, "op", "n", 5, chain, image(model, 2), complete=True, over_base=base)
    assert chain3[0] == base and len(chain3) == 2 and chain3[1].checkpoint_id == 3
    assert as_dict(store.read_chain(chain3)) == model
    # an ordinary delta goes on top of it
    chain4 = store.write_key_group(4, "op", "n", 5, chain3, delta([(3, 7, 0), (6, None, 1), (1000, 1, 0)]))
    assert chain4[:2] == chain3 and len(chain4) == 3
    model.update({3: 7, 1000: 1})
    del model[6]
    assert as_dict(store.read_chain(chain4)) == model


def test_an_image_is_a_new_base_when_its_base_no_longer_heads_the_chain_or_its_rows_differ(store):
    model = {k: k for k in range(50)}
    (base,) = store.write_key_group(1, "op", "n", 0, [], image(model), complete=True)
    (other,) = store.write_key_group(2, "op", "n", 0, [], image(model), complete=True)
    chain = store.write_key_group(3, "op", "n", 0, [other], image(model), complete=True, over_base=base)
    assert len(chain) == 1 and chain[0].kind == "base" and chain[0].checkpoint_id == 3
    bigger = {**model, 99: 1}
    chain = store.write_key_group(4, "op", "n", 0, [base], image(bigger), complete=True, over_base=base)
    assert len(chain) == 1 and chain[0].kind == "base" and as_dict(store.read_chain(chain)) == bigger


def test_a_policy_that_always_compacts_gets_a_base_instead_of_a_values_image(memory_root):
    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=0.0))
    model = {k: k for k in range(100)}
    (base,) = store.write_key_group(1, "op", "n", 0, [], image(model), complete=True)
    chain = store.write_key_group(2, "op", "n", 0, [base], image(model), complete=True, over_base=base)
    assert len(chain) == 1 and chain[0].kind == "base" and chain[0].checkpoint_id == 2


def test_values_images_are_packed_with_the_other_key_groups_files(store):
    store.share_below = 0  # small bases in a shared range (format 6) are cheaper than values images: see below
    models = {kg: {k: k + kg for k in range(kg, 300, 7)} for kg in range(4)}
    first = store.write_key_groups(1, [KeyGroupWrite("op", "n", kg, [], image(m), True) for kg, m in models.items()])
    second = store.write_key_groups(2, [KeyGroupWrite("op", "n", kg, first[kg], image({k: -v for k, v in m.items()}), True,
                                                      None, first[kg][0]) for kg, m in models.items()])
    assert len({r[1].path for r in second}) == 1 and all(r[1].offset is not None for r in second)
    for kg, m in models.items():
        assert second[kg][0] == first[kg][0]
        assert as_dict(store.read_chain(second[kg])) == {k: -v for k, v in m.items()}


def test_small_images_over_bases_in_a_shared_range_are_new_bases_in_one_shared_range(store):
    """A values image has a stream of its own (its keys digest makes its schema unique), which
    costs more than its share of one stream with the other small bases."""
    models = {kg: {k: k + kg for k in range(kg, 300, 7)} for kg in range(4)}
    first = store.write_key_groups(1, [KeyGroupWrite("op", "n", kg, [], image(m), True) for kg, m in models.items()])
    assert all(chain[0].shared for chain in first)
    second = store.write_key_groups(2, [KeyGroupWrite("op", "n", kg, first[kg], image({k: -v for k, v in m.items()}), True,
                                                      None, first[kg][0]) for kg, m in models.items()])
    assert all(len(chain) == 1 and chain[0].shared and chain[0].checkpoint_id == 2 for chain in second)
    for kg, m in models.items():
        assert as_dict(store.read_chain(second[kg])) == {k: -v for k, v in m.items()}


def test_a_values_image_written_for_other_keys_fails_the_restore_naming_the_digest(store):
    (base,) = store.write_key_group(1, "op", "n", 0, [], image({1: 1, 2: 2, 3: 3}), complete=True)
    # a writer that broke its promise: same row count, other keys
    chain = store.write_key_group(2, "op", "n", 0, [base], image({1: 10, 2: 20, 4: 40}), complete=True, over_base=base)
    assert len(chain) == 2
    with pytest.raises(DeltaSchemaError, match="written for other keys than its base's"):
        store.read_chain(chain)


def test_a_restore_refuses_a_values_image_whose_columns_are_not_its_bases(store):
    """read_chain decodes a base under a values image without its values: the image's columns
    are checked against the schema of the base's file, not against the decoded columns."""
    (base,) = store.write_key_group(1, "op", "n", 0, [], image({1: 1, 2: 2}), complete=True)
    renamed = image({1: 10, 2: 20}).rename_columns(["key", "count"])
    chain = store.write_key_group(2, "op", "n", 0, [base], renamed, complete=True, over_base=base)
    assert len(chain) == 2 and store.read_file(chain[1]).column_names == ["count"]
    with pytest.raises(DeltaSchemaError, match=r"its columns \['count'\] are not the base's value columns \['value'\]"):
        store.read_chain(chain)


def test_a_restore_keeps_the_bases_column_order():
    two = pa.table({"key": pa.array([1, 2], pa.int64()), "b": [1, 2], "a": [3, 4]}).replace_schema_metadata(META)
    values = values_image(two.select(["key", "a", "b"]))
    keys_only = two.select(["key"])
    out = resolve_chain([keys_only, values], first_is_base=True, base_schema=two.schema)
    assert out.column_names == ["key", "b", "a"] and out.to_pydict() == two.to_pydict()


def test_a_values_image_anywhere_but_right_after_the_base_is_refused():
    base = image({1: 1, 2: 2})
    values = values_image(image({1: 5, 2: 6}))
    assert values is not None and values.column_names == ["value"]
    assert as_dict(resolve_chain([base, values], first_is_base=True)) == {1: 5, 2: 6}
    with pytest.raises(DeltaSchemaError, match="only directly after its chain's base"):
        resolve_chain([base, delta([(1, 3, 0)]), values], first_is_base=True)
    with pytest.raises(DeltaSchemaError, match="only directly after its chain's base"):
        resolve_chain([values], first_is_base=False)
    with pytest.raises(DeltaSchemaError, match="it has 1 rows and its base 2"):
        resolve_chain([base, values.slice(0, 1)], first_is_base=True)
    stripped = values.replace_schema_metadata(META)
    with pytest.raises(DeltaSchemaError, match="keys digest 'absent'"):
        resolve_chain([base, stripped], first_is_base=True)
    renamed = values.rename_columns(["count"])
    with pytest.raises(DeltaSchemaError, match="not the base's value columns"):
        resolve_chain([base, renamed], first_is_base=True)


def test_only_unique_int64_keys_make_a_values_image():
    assert values_image(pa.table({"key": ["a", "b"], "value": [1, 2]})) is None
    assert values_image(pa.table({"key": pa.array([1, 1], pa.int64()), "value": [1, 2]})) is None
    assert values_image(delta([(1, 1, 0), (2, None, 1)])) is None  # a delete: not a full image
    assert join_byte_streams(values_image(delta([(2, 1, 0), (1, 5, 0)]))).column("value").to_pylist() == [5, 1]  # in key order


@st.composite
def histories(draw):
    steps = draw(st.lists(st.one_of(
        st.tuples(st.just("image"), st.sampled_from([True, True, True, False]), st.integers(0, 3)),  # (same keys?, seed)
        st.tuples(st.just("image"), st.just(True), st.integers(0, 3)),
        st.tuples(st.just("delta"), st.lists(st.tuples(st.integers(0, 40), st.integers(-5, 5), st.sampled_from([0, 0, 1])),
                                             max_size=10), st.none()),
    ), min_size=1, max_size=12))
    policy = CompactionPolicy(max_chain_length=draw(st.integers(1, 4)), max_delta_ratio=draw(st.sampled_from([0.3, 1.0, 100.0, 100.0])))
    return steps, policy


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(histories())
def test_chains_with_values_images_equal_the_model_after_every_checkpoint(history):
    """The runtime's writer rule, modelled: an image goes over the base when the key set is
    the one the base was written with and that base still heads the chain."""
    steps, policy = history
    name = f"/values-{uuid.uuid4().hex}"
    store = SnapshotStore.open(f"memory://{name}", policy=policy)
    try:
        model: dict[int, int | None] = {}
        chain: list = []
        base_keys: tuple | None = None  # keys of the base the writer wrote last, and that base
        for cid, (kind, arg, seed) in enumerate(steps, start=1):
            if kind == "image":
                if arg and model:
                    model = {k: (v or 0) + cid for k, v in model.items()}
                else:
                    model = {k: k * cid for k in range(seed, 30 + seed, seed + 1)}
                over = base_keys[1] if base_keys and chain and chain[0] == base_keys[1] and base_keys[0] == set(model) else None
                new = store.write_key_group(cid, "op", "n", 3, chain, image(model, cid), complete=True, over_base=over)
                if over is not None and policy.max_delta_ratio >= 1.0 and policy.max_chain_length >= 2:
                    # the values alone, over the same base, unless they take more bytes than the
                    # policy allows beside it (a few keys with small values: the image's digest
                    # outweighs the keys), sized as the writer sizes them
                    vi = _encode(values_image(image(model, cid)), "delta", SHARE_BELOW).encoded.size
                    if vi <= over.bytes * policy.max_delta_ratio:
                        assert new[0] == over and len(new) == 2
                    else:
                        assert new[0].checkpoint_id == cid and len(new) == 1  # a new base instead
                if new and new[0].checkpoint_id == cid:
                    base_keys = (set(model), new[0])
            else:
                for k, v, op in arg:
                    if op:
                        model.pop(k, None)
                    else:
                        model[k] = v
                new = store.write_key_group(cid, "op", "n", 3, chain, delta(arg))
            chain = new
            for i, ref in enumerate(chain):
                assert "key" in store.read_file(ref).column_names or i == 1
            assert (as_dict(store.read_chain(chain)) if chain else {}) == model
    finally:
        fsspec.filesystem("memory").rm(name, recursive=True)


def test_a_file_decodes_with_only_the_columns_asked_for():
    """read_chain decodes a base under a values image this way: its values are dead."""
    from storage.format import decode_table, encode_table

    data = encode_table(image({1: 10, 2: 20}), "base").data
    assert decode_table(data, source="t", columns=["key"]).to_pydict() == {"key": [1, 2]}
    assert decode_table(data, source="t", columns=["value", "absent"]).to_pydict() == {"value": [10, 20]}
    assert decode_table(data, source="t").column_names == ["key", "value"]


NUMERIC = [pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint16(), pa.uint32(), pa.uint64(),
           pa.float16(), pa.float32(), pa.float64()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_byte_stream_split_columns_join_back_to_the_same_table(data):
    """Format 8: every numeric column of 2 to 8 bytes without nulls is stored split (a
    fixed_size_binary of its width naming its type), the others as they are; joining gives
    the very table back, whatever slice or chunking it came in."""
    n = data.draw(st.integers(0, 40))
    types = data.draw(st.lists(st.sampled_from(NUMERIC), min_size=1, max_size=4))
    cols = {}
    for i, t in enumerate(types):
        raw = np.frombuffer(data.draw(st.binary(min_size=n * max(1, t.bit_width // 8), max_size=n * max(1, t.bit_width // 8))),
                            np.uint8).view(t.to_pandas_dtype())
        mask = np.array(data.draw(st.lists(st.booleans(), min_size=n, max_size=n)), bool) if data.draw(st.booleans()) else None
        cols[f"c{i}"] = pa.array(raw, t, mask=mask)
    table = pa.table(cols).replace_schema_metadata({b"k": b"v"})
    lo = data.draw(st.integers(0, n))
    table = table.slice(lo, data.draw(st.integers(0, n - lo)))
    split = split_byte_streams(table)
    for field, col in zip(split.schema, table.columns):
        splits = field.metadata is not None and META_BYTE_STREAM_SPLIT in field.metadata
        assert splits == (col.type.bit_width >= 16 and not col.null_count and len(col) > 0)
        if splits:
            assert field.type == pa.binary(col.type.bit_width // 8) and field.metadata[META_BYTE_STREAM_SPLIT] == str(col.type).encode()
    joined = join_byte_streams(split)
    assert joined.schema == table.schema and joined.schema.metadata == table.schema.metadata
    for a, b in zip(joined.columns, table.columns):  # bit for bit (NaN payloads too)
        assert a.combine_chunks().buffers()[1:] == b.combine_chunks().buffers()[1:] or np.array_equal(
            a.to_numpy().view(np.uint8), b.to_numpy().view(np.uint8))
    two = pa.Table.from_batches(split.to_batches(max_chunksize=3) or [], schema=split.schema)
    assert join_byte_streams(two).schema == table.schema


def test_a_values_image_file_is_split_and_reads_back(store):
    """The store writes an int64 values image byte-stream split: the file's column is
    fixed_size_binary(8) marked int64, and the chain resolves to the new values."""
    model = {k: (k * 7919) << 20 for k in range(0, 3000, 3)}
    (base,) = store.write_key_group(1, "op", "n", 0, [], image(model), complete=True)
    model2 = {k: v + k for k, v in model.items()}
    chain = store.write_key_group(2, "op", "n", 0, [base], image(model2, 1), complete=True, over_base=base)
    assert len(chain) == 2
    raw = store.read_file(chain[1])
    assert raw.schema.field("value").type == pa.binary(8)
    assert raw.schema.field("value").metadata[META_BYTE_STREAM_SPLIT] == b"int64"
    assert as_dict(store.read_chain(chain)) == model2


def test_a_split_column_marked_with_an_unknown_type_is_refused_by_name():
    base = image({1: 1, 2: 2})
    values = values_image(image({1: 5, 2: 6}))
    field = values.schema.field("value")
    for mark in (b"decimal", b"int32"):  # a type never split; one of another width
        bad = values.cast(pa.schema([field.with_metadata({META_BYTE_STREAM_SPLIT: mark})], metadata=values.schema.metadata))
        where = f"column 'value' is marked byte-stream split as '{mark.decode()}' but is fixed_size_binary[8]"
        with pytest.raises(DeltaSchemaError, match=r"a values image is unreadable: " + re.escape(where)):
            resolve_chain([base, bad], first_is_base=True)


def test_a_write_given_its_values_image_builds_the_delta_only_when_it_writes_another_file(store):
    """KeyGroupWrite.values_image with rows: a values image over the base is written from it
    alone (the delta is never built); where the decision writes something else (the image's
    rows are not the base's), the delta is built and written as before."""
    model = {k: k * 10 for k in range(0, 3000, 3)}
    (base,) = store.write_key_group(1, "op", "n", 0, [], image(model), complete=True)
    built: list[int] = []

    def lazy(table: pa.Table):
        def make() -> pa.Table:
            built.append(table.num_rows)
            return table
        return make

    new = {k: v + 1 for k, v in model.items()}
    (chain,) = store.write_key_groups(2, [KeyGroupWrite("op", "n", 0, [base], lazy(image(new)), True, None, base,
                                                       lambda: values_image(image(new)), len(new))])
    assert not built and chain[0] == base and len(chain) == 2
    assert store.read_file(chain[1]).column_names == ["value"] and as_dict(store.read_chain(chain)) == new
    bigger = {**new, 5000: 1}
    (chain,) = store.write_key_groups(3, [KeyGroupWrite("op", "n", 0, chain, lazy(image(bigger)), True, None, base,
                                                       lambda: values_image(image(bigger)), len(bigger))])
    assert built == [len(bigger)] and len(chain) == 1 and chain[0].kind == "base"
    assert as_dict(store.read_chain(chain)) == bigger
