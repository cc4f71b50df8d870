"""What a micro-batch source's readers had read at a checkpoint's offsets, from the staged
batches (tests of ``SparkMicroBatchSource`` with Spark's rate source, whose rows carry
consecutive ``id``s: each micro-batch a range of them)."""
from __future__ import annotations

import json


def staged_batches(fs, staging: str) -> dict:
    """Batch id -> the values of each of its staged parts, in the manifest's order."""
    import pyarrow.parquet as pq

    batches = {}
    for directory in fs.ls(staging.removeprefix("s3://")):
        name = directory.rsplit("/", 1)[-1]
        if not name.startswith("batch-") or not fs.exists(f"{directory}/_manifest.json"):
            continue
        with fs.open(f"{directory}/_manifest.json", "rb") as f:
            parts = json.load(f)["parts"]
        values = []
        for part in parts:
            with fs.open(f"{directory}/{part['file']}", "rb") as f:
                values.append(pq.read_table(f, columns=["id"]).column("id").to_pylist())
        batches[int(name[6:])] = values
    return batches


def rows_read(offsets: dict, staged: dict, lanes: int) -> set | None:
    """The ``id``s a micro-batch source's readers had emitted at ``offsets`` (lane ->
    batch, part, row): lane L reads parts k = L - b (mod lanes) of batch b. Batches older than
    every staged one were read whole and deleted (their values are those below the oldest
    staged). None when no batch with rows is staged any more: the readers had then read every
    batch whole, so what they read is a prefix 0 .. n-1 of the ids, its n not known here."""
    low = min((min(part) for b in sorted(staged) for part in staged[b] if part), default=None)
    if low is None:
        return None
    got = set(range(low))
    for lane, o in offsets.items():
        for b in sorted(staged):
            if b > o["batch"]:
                break
            parts = staged[b]
            for k in range((int(lane) - b) % lanes, len(parts), lanes):
                if b < o["batch"] or k < o["part"]:
                    got.update(parts[k])
                elif k == o["part"]:
                    got.update(parts[k][:o["row"]])
    return got


def check_committed(ids: list, before: set | None, latest: set | None) -> tuple[int, int]:
    """(rows read at the earlier checkpoint missing from the committed ``ids``, committed rows
    beyond what the latest had read); the ids must be distinct. Where nothing is staged any
    more (``None``), the committed rows must be a prefix 0 .. n-1 of the ids."""
    got = set(ids)
    assert len(got) == len(ids), "a row committed twice"
    prefix = set(range(len(ids)))
    missing = len((before if before is not None else set()) - got)
    beyond = len(got - (latest if latest is not None else prefix))
    return missing, beyond
