"""The restore plan is authoritative: each worker receives exactly its key groups' chains."""
from __future__ import annotations

import collections

import numpy as np
import pyarrow as pa
import pytest

import abs
from abs.keygroups import key_group_range
from abs.runtime.driver import JobDriver
from storage import SnapshotStore

pytestmark = pytest.mark.integration

NUM_KEYS = 300
TOTAL = 30_000


def count_fn(ctx, row):
    n = ctx.state.n
    c = (n.value() or 0) + 1
    n.update(c)
    ctx.emit({"key": ctx.key, "count": c})


def counting_flow(rate: int | None = None) -> abs.Dataflow:
    src = abs.GeneratorSource(TOTAL, num_keys=NUM_KEYS, num_splits=6, batch_size=200, rate=rate)
    flow = abs.Dataflow("plan-owned")
    flow.source("src", src).key_by("key").process(
        "count", count_fn, state=[abs.ValueState("n", pa.int64())]
    ).sink("out", abs.CollectSink())
    return flow


def assert_exact_running_counts(out: pa.Table) -> None:
    per_key: dict[int, list[int]] = collections.defaultdict(list)
    for k, c in zip(out.column("key").to_pylist(), out.column("count").to_pylist()):
        per_key[k].append(c)
    expected = collections.Counter((np.arange(TOTAL) % NUM_KEYS).tolist())
    assert set(per_key) == set(expected)
    for k, counts in per_key.items():
        assert counts == list(range(1, expected[k] + 1)), f"key {k}"


def test_a_restore_at_p8_gives_each_worker_exactly_its_own_key_groups_and_exact_output(tmp_path):
    # a checkpoint taken at P = 3 in the middle of the stream (the input is rate-limited to
    # about 40 s, so that two checkpoints fit in it on a busy machine; trigger_checkpoint
    # returns once the manifest is committed, and the job is canceled right after)
    job = abs.submit(counting_flow(rate=125), parallelism=3, storage=str(tmp_path),
                     checkpoint=abs.CheckpointConfig(interval=60))
    job.trigger_checkpoint()
    last = job.trigger_checkpoint()
    first = job.cancel()
    assert first.completed_checkpoints[-1].checkpoint_id >= last
    assert 0 < first.collected("out").num_rows < TOTAL, "the checkpoint should fall in the middle of the stream"
    restored_id = first.completed_checkpoints[-1].checkpoint_id
    manifest = SnapshotStore.open(str(tmp_path)).read_manifest(restored_id)
    assert manifest.stats["parallelism"] == 3
    stored = manifest.keyed["count"]["n"]
    assert len(stored) > 8  # every new worker has key groups to restore

    driver = JobDriver(counting_flow(), parallelism=8, checkpoint=abs.CheckpointConfig(interval=0.5),
                       storage=str(tmp_path), storage_options=None, restore="latest", executor=None,
                       # 8 workers starting on a busy machine may miss a start-up deadline: a
                       # restart restores the same checkpoint through the same plan
                       restart=abs.RestartStrategy(max_restarts=3))
    second = driver.run()
    assert second.status == "FINISHED" and second.restored_from == restored_id

    # what each worker reports it received in its restore assignment: only its own range,
    # and together every key group of the checkpoint exactly once
    seen: list[int] = []
    for i, got in enumerate(driver.restored_key_groups):
        own = key_group_range(manifest.max_parallelism, 8, i)
        kgs = got["count"]["n"]
        assert kgs, f"worker {i} received no key group"
        assert all(kg in own for kg in kgs), f"worker {i} received key groups outside {own}: {kgs}"
        assert set(kgs) == {kg for kg in stored if kg in own}, f"worker {i}"
        seen.extend(kgs)
        assert second.bytes_restored_per_worker[i] == sum(r.bytes for kg in kgs for r in stored[kg])
    assert sorted(seen) == sorted(stored)
    # the result is exact: each record counted once, in order, across the two runs
    assert_exact_running_counts(pa.concat_tables([first.collected("out"), second.collected("out")]))
