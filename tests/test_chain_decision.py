"""The chain decision (storage.chain_decision): pure, the same as the store's former inline
rule, and the chains it builds restore to the model's state within the policy's bounds."""
from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from storage import CompactionPolicy
from storage.chain_decision import (CaptureFacts, ChainAction, ChainDecision, ChainFacts, Fact, NeedFact,
                                    decide_chain)
from storage.chains import compaction_reason_of_sizes

A = ChainAction


# ----------------------------------------------------------------------------- the former rule
@dataclasses.dataclass
class World:
    """What learning each fact yields, and the facts learnt, in order."""

    values_image_bytes: int | None  # None: the capture makes no values image
    delta_bytes: int
    image_exists: bool
    asked: list = dataclasses.field(default_factory=list)

    def value(self, fact: Fact) -> Any:
        self.asked.append(fact)
        return {Fact.VALUES_IMAGE: self.values_image_bytes, Fact.DELTA_BYTES: self.delta_bytes,
                Fact.IMAGE: self.image_exists}[fact]


def former_rule(policy: CompactionPolicy, chain: ChainFacts, rows: int, complete: bool, over_base: bool,
                has_image: bool, world: World) -> tuple[ChainAction, int]:
    """``SnapshotStore._plan_key_group`` as it was before the decision moved out of it, with
    its encoding and ``image()`` calls replaced by asking ``world``: (action, files kept)."""
    sizes = list(chain.file_bytes)
    if complete and over_base and chain.base_is_over_base and rows == chain.base_rows:
        size = world.value(Fact.VALUES_IMAGE)
        if size is not None:
            if compaction_reason_of_sizes(policy, sizes[:1], size) is None:
                return A.VALUES_IMAGE, 1
    if not sizes or (complete and rows):
        return A.BASE, 0
    if complete:
        return A.DROP, 0
    if rows == 0:
        return A.KEEP, len(sizes)
    full = None
    if has_image and chain.base_rows:
        estimate = sizes[0] * rows // chain.base_rows
        if compaction_reason_of_sizes(policy, sizes, estimate) is not None:
            full = world.value(Fact.IMAGE) or None
    if full is None:
        if compaction_reason_of_sizes(policy, sizes, world.value(Fact.DELTA_BYTES)) is None:
            return A.DELTA, len(sizes)
        full = world.value(Fact.IMAGE) if has_image else None
    if full:
        return A.COMPACT_FROM_IMAGE, 0
    return A.COMPACT_BY_READING, 0


def run_decision(policy: CompactionPolicy, chain: ChainFacts, capture: CaptureFacts, world: World) -> ChainDecision:
    """Drive :func:`decide_chain` as the store does: learn each fact it asks for, ask again."""
    for _ in range(4):
        decision = decide_chain(policy, chain, capture)
        if isinstance(decision, ChainDecision):
            return decision
        assert decision.fact not in world.asked, f"{decision.fact} asked for twice"
        capture = capture.learn(decision.fact, world.value(decision.fact))
    raise AssertionError("decide_chain asked for more facts than there are")


policies = st.builds(CompactionPolicy, max_chain_length=st.integers(1, 5),
                     max_delta_ratio=st.sampled_from([0.0, 0.05, 0.5, 1.0, 2.0, 1000.0]))
sizes = st.integers(0, 5000)


@st.composite
def situations(draw):
    files = tuple(draw(st.lists(sizes, max_size=5)))
    chain = ChainFacts(files, draw(st.integers(0, 50)) if files else 0, bool(files) and draw(st.booleans()))
    rows = draw(st.one_of(st.integers(0, 60), st.just(chain.base_rows)))
    capture = CaptureFacts(rows=rows, complete=draw(st.booleans()), over_base=draw(st.booleans()),
                           has_image=draw(st.booleans()))
    world = World(draw(st.one_of(st.none(), sizes)), draw(sizes), draw(st.booleans()))
    return draw(policies), chain, capture, world


@settings(max_examples=2000, deadline=None)
@given(situations())
def test_the_decision_equals_the_former_rule_and_asks_for_no_more_work(situation):
    policy, chain, capture, world = situation
    former = World(world.values_image_bytes, world.delta_bytes, world.image_exists)
    expected = former_rule(policy, chain, capture.rows, capture.complete, capture.over_base, capture.has_image, former)
    decision = run_decision(policy, chain, capture, world)
    assert (decision.action, decision.keep) == expected
    # the same work in the same order; the former rule called an image that returned None twice
    assert world.asked == list(dict.fromkeys(former.asked))
    assert decision.reason is not None or decision.action is not A.COMPACT_BY_READING


def ref_chain(*file_bytes: int, base_rows: int = 100, over: bool = False) -> ChainFacts:
    return ChainFacts(tuple(file_bytes), base_rows, over)


POLICY = CompactionPolicy(max_chain_length=3, max_delta_ratio=1.0)


@pytest.mark.parametrize("chain, capture, world, expected", [
    # the first capture is a base, whatever it holds
    (ref_chain(), CaptureFacts(rows=5), World(None, 50, False), (A.BASE, 0, [])),
    (ref_chain(), CaptureFacts(rows=0), World(None, 50, False), (A.BASE, 0, [])),
    # a full image with rows restarts the chain; without rows it empties it
    (ref_chain(1000, 10), CaptureFacts(rows=7, complete=True), World(None, 50, False), (A.BASE, 0, [])),
    (ref_chain(1000, 10), CaptureFacts(rows=0, complete=True), World(None, 50, False), (A.DROP, 0, [])),
    # an empty delta writes nothing
    (ref_chain(1000, 10), CaptureFacts(rows=0), World(None, 50, False), (A.KEEP, 2, [])),
    # a delta within the bounds is appended
    (ref_chain(1000, 10), CaptureFacts(rows=3), World(None, 400, False), (A.DELTA, 2, [Fact.DELTA_BYTES])),
    # too many bytes: compacted by reading back, or from the image when the writer has one
    (ref_chain(1000, 10), CaptureFacts(rows=3), World(None, 991, False),
     (A.COMPACT_BY_READING, 0, [Fact.DELTA_BYTES])),
    (ref_chain(1000, 10), CaptureFacts(rows=3, has_image=True), World(None, 991, True),
     (A.COMPACT_FROM_IMAGE, 0, [Fact.DELTA_BYTES, Fact.IMAGE])),
    (ref_chain(1000, 10), CaptureFacts(rows=3, has_image=True), World(None, 991, False),
     (A.COMPACT_BY_READING, 0, [Fact.DELTA_BYTES, Fact.IMAGE])),
    # too long a chain
    (ref_chain(1000, 1, 1), CaptureFacts(rows=1), World(None, 1, False), (A.COMPACT_BY_READING, 0, [Fact.DELTA_BYTES])),
    # the estimate (base bytes per row x rows) already compacts: the delta is never encoded
    (ref_chain(1000, base_rows=10), CaptureFacts(rows=20, has_image=True), World(None, 5, True),
     (A.COMPACT_FROM_IMAGE, 0, [Fact.IMAGE])),
    # ... unless the image is missing: then the encoded delta decides
    (ref_chain(1000, base_rows=10), CaptureFacts(rows=20, has_image=True), World(None, 5, False),
     (A.DELTA, 1, [Fact.IMAGE, Fact.DELTA_BYTES])),
    # a full image over the unchanged base heading the chain is a values image
    (ref_chain(1000, 300, base_rows=8, over=True), CaptureFacts(rows=8, complete=True, over_base=True),
     World(400, 50, False), (A.VALUES_IMAGE, 1, [Fact.VALUES_IMAGE])),
    # ... but a new base when it makes none, the policy refuses the pair, or its rows differ
    (ref_chain(1000, base_rows=8, over=True), CaptureFacts(rows=8, complete=True, over_base=True),
     World(None, 50, False), (A.BASE, 0, [Fact.VALUES_IMAGE])),
    (ref_chain(1000, base_rows=8, over=True), CaptureFacts(rows=8, complete=True, over_base=True),
     World(1001, 50, False), (A.BASE, 0, [Fact.VALUES_IMAGE])),
    (ref_chain(1000, base_rows=8, over=True), CaptureFacts(rows=9, complete=True, over_base=True),
     World(400, 50, False), (A.BASE, 0, [])),
    (ref_chain(1000, base_rows=8, over=False), CaptureFacts(rows=8, complete=True, over_base=True),
     World(400, 50, False), (A.BASE, 0, [])),
])
def test_the_decision_on_cases_of_the_former_rule(chain, capture, world, expected):
    decision = run_decision(POLICY, chain, capture, world)
    assert (decision.action, decision.keep, world.asked) == expected


def test_a_policy_of_one_file_never_accepts_a_values_image():
    chain = ref_chain(1000, base_rows=8, over=True)
    capture = CaptureFacts(rows=8, complete=True, over_base=True)
    decision = run_decision(CompactionPolicy(max_chain_length=1), chain, capture, World(1, 1, False))
    assert decision.action is A.BASE


def test_compaction_names_its_reason():
    decision = run_decision(POLICY, ref_chain(1000, 1, 1), CaptureFacts(rows=1), World(None, 1, False))
    assert decision.reason == "chain length 4 > 3"
    decision = run_decision(POLICY, ref_chain(1000, base_rows=10), CaptureFacts(rows=20, has_image=True),
                            World(None, 5, True))
    assert decision.reason == "delta/base bytes 2.00 > 1.0 (estimated)"


def test_learning_a_fact_leaves_the_others_as_they_were():
    capture = CaptureFacts(rows=3, has_image=True)
    assert capture.learn(Fact.VALUES_IMAGE, None) == dataclasses.replace(capture, values_image_fits=False)
    assert capture.learn(Fact.VALUES_IMAGE, 12) == dataclasses.replace(capture, values_image_fits=True,
                                                                       values_image_bytes=12)
    assert capture.learn(Fact.DELTA_BYTES, 7).delta_bytes == 7
    assert capture.learn(Fact.IMAGE, False).image_exists is False
    assert isinstance(decide_chain(POLICY, ref_chain(10, base_rows=1), capture), NeedFact)


# ----------------------------------------------------------------------------- against a model
DELETE = object()
ROW_BYTES = 10  # a file's size in this model: 10 bytes per row plus a 20-byte header


def file_bytes(rows: int) -> int:
    return 20 + ROW_BYTES * rows


@dataclasses.dataclass
class ModelFile:
    kind: str  # "base", "delta" or "values"
    rows: dict  # key -> value (or DELETE in a delta); a values image: the base's keys in order

    @property
    def size(self) -> int:
        return file_bytes(len(self.rows))


def restore(chain: list[ModelFile]) -> dict:
    state: dict = {}
    for i, f in enumerate(chain):
        if f.kind == "values":
            assert i == 1 and list(f.rows) == list(chain[0].rows), "a values image over another base's keys"
        for k, v in f.rows.items():
            if v is DELETE:
                state.pop(k, None)
            else:
                state[k] = v
    return state


captures = st.lists(
    st.tuples(
        st.sampled_from(["changes", "changes", "full", "values"]),  # what the writer captured
        st.dictionaries(st.integers(0, 9), st.one_of(st.integers(0, 99), st.just(DELETE)), max_size=8),
        st.booleans(),  # the writer has the full image on request
        st.booleans(),  # the values image qualifies (unique int64 keys)
    ),
    min_size=1, max_size=12,
)


@settings(max_examples=400, deadline=None)
@given(policies, captures)
def test_chains_built_by_the_decisions_restore_to_the_model_within_the_policys_bounds(policy, steps):
    model: dict = {}
    chain: list[ModelFile] = []
    for what, changes, has_image, fits in steps:
        over = what == "values" and bool(chain) and set(model) == set(chain[0].rows)
        if over:  # new values for exactly the keys of the chain's base: a full image over it
            changes = {k: changes.get(k, model[k] + 1) for k in chain[0].rows}
            changes = {k: (0 if v is DELETE else v) for k, v in changes.items()}
        elif what == "values":
            what = "full"
        for k, v in changes.items():
            if v is DELETE:
                model.pop(k, None)
            else:
                model[k] = v
        complete = what in ("full", "values")
        if what == "full":  # every live key as an upsert
            changes = dict(model)
        facts = ChainFacts(tuple(f.size for f in chain), len(chain[0].rows) if chain else 0, over)
        capture = CaptureFacts(rows=len(changes), complete=complete, over_base=over, has_image=has_image)
        world = World(file_bytes(len(changes)) if fits else None, file_bytes(len(changes)), has_image)
        decision = run_decision(policy, facts, capture, world)
        live = {k: v for k, v in changes.items() if v is not DELETE}
        if decision.action is A.KEEP:
            assert not changes
        elif decision.action is A.DROP:
            chain = []
        elif decision.action is A.BASE:
            chain = [ModelFile("base", live)]
        elif decision.action is A.VALUES_IMAGE:
            chain = chain[:1] + [ModelFile("values", {k: changes[k] for k in chain[0].rows})]
        elif decision.action is A.DELTA:
            chain = chain[:decision.keep] + [ModelFile("delta", dict(changes))]
        elif decision.action is A.COMPACT_FROM_IMAGE:
            chain = [ModelFile("base", dict(model))]
        else:
            chain = [ModelFile("base", restore(chain + [ModelFile("delta", dict(changes))]))]
        assert restore(chain) == model
        assert len(chain) <= policy.max_chain_length
        if len(chain) > 1:  # the bytes the policy promises: deltas within the ratio of the base
            assert sum(f.size for f in chain[1:]) <= policy.max_delta_ratio * max(chain[0].size, 1)


# ----------------------------------------------------------------------------- through the store
def counted(result):
    calls = []

    def image():
        calls.append(1)
        return result

    return image, calls


def table(rows: dict) -> "pa.Table":
    import pyarrow as pa

    return pa.table({"key": pa.array(list(rows), pa.int64()), "value": pa.array(list(rows.values()), pa.int64())})


def test_the_store_asks_for_a_missing_image_once_and_compacts_by_reading(memory_root):
    from storage import SnapshotStore

    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_chain_length=2))
    chain = store.write_key_group(1, "op", "n", 0, [], table({1: 1, 2: 2}))
    chain = store.write_key_group(2, "op", "n", 0, chain, table({2: 20}))
    image, calls = counted(None)
    chain = store.write_key_group(3, "op", "n", 0, chain, table({3: 30}), image=image)
    assert len(calls) == 1  # the former rule called it again after encoding the delta
    assert len(chain) == 1 and chain[0].kind == "base"
    assert store.read_chain(chain).to_pydict() == {"key": [1, 2, 3], "value": [1, 20, 30]}


def test_the_store_writes_the_image_as_the_new_base_when_the_estimate_compacts(memory_root):
    from storage import SnapshotStore

    store = SnapshotStore.open(memory_root, policy=CompactionPolicy(max_delta_ratio=0.5))
    chain = store.write_key_group(1, "op", "n", 0, [], table({k: k for k in range(10)}))
    image, calls = counted(table({k: -k for k in range(12)}))
    chain = store.write_key_group(2, "op", "n", 0, chain, table({k: -k for k in range(12)}), image=image)
    assert len(calls) == 1 and len(chain) == 1 and chain[0].checkpoint_id == 2 and chain[0].rows == 12
