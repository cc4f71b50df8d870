"""The test helper ``pacing.PacedSource``: progress follows completed checkpoints, output is
the inner source's."""
from __future__ import annotations

import collections

import abs
from pacing import PacedSource


def test_a_paced_source_emits_its_records_once_and_needs_a_checkpoint_per_step(tmp_path):
    flow = abs.Dataflow("paced")
    # one reader, 8,000 records, 1,000 per completed checkpoint: 7 completions at least
    flow.source("src", PacedSource(abs.GeneratorSource(8_000, num_keys=10, num_splits=2, batch_size=250), 1_000)) \
        .sink("out", abs.CollectSink())
    result = abs.run(flow, parallelism=1, storage=str(tmp_path), checkpoint=abs.CheckpointConfig(interval=0.05))
    assert result.status == "FINISHED"
    assert collections.Counter(result.collected("out").column("seq").to_pylist()) == {i: 1 for i in range(8_000)}
    assert len(result.completed_checkpoints) >= 7
