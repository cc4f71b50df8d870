"""Connected components of a stream of edges by label propagation in a loop: every node's
label is the smallest node id it is connected to. A node that learns a smaller label sends it
round the loop to its neighbours (keyed state inside the loop: each node's label and
neighbours). The job ends once no label circulates any more. Checkpoints every 0.2 s go into a
new temporary directory, or into STORAGE when given; a run into a STORAGE that already holds
checkpoints starts from empty state all the same (``restore="fresh"``: its checkpoint ids
continue above the ones there). It prints where the snapshots are.

    .venv/bin/python examples/connected_components.py [STORAGE] [--nodes N] [--edges E] [--workers P]
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np
import pyarrow as pa

import abs

EDGE, LABEL, OUT = 0, 1, 2  # the kinds of records in the loop (and leaving it)


def random_edges(nodes: int, edges: int, seed: int = 7) -> abs.GeneratorSource:
    """``edges`` edges ``(src, dst)`` between ``nodes`` nodes, a pure function of the record index."""
    def make(idx):
        rng = np.random.default_rng(seed)
        pairs = rng.integers(0, nodes, size=(edges, 2))
        return pa.RecordBatch.from_arrays([pa.array(pairs[idx, 0]), pa.array(pairs[idx, 1])], names=["src", "dst"])
    return abs.GeneratorSource(count=edges, make_batch=make, batch_size=256)


def both_ways(edge: dict) -> list[dict]:
    s, d = edge["src"], edge["dst"]
    return [{"node": s, "other": d, "label": -1, "kind": EDGE}, {"node": d, "other": s, "label": -1, "kind": EDGE}]


def propagate(ctx, r: dict) -> None:
    node = ctx.key
    label = ctx.state.label.value()
    if label is None:
        label = node
        ctx.state.label.update(label)
        ctx.emit({"node": node, "other": -1, "label": label, "kind": OUT})
    if r["kind"] == EDGE:
        ctx.state.neighbours.add(r["other"])
        ctx.emit({"node": r["other"], "other": node, "label": label, "kind": LABEL})  # tell the new neighbour
    elif r["label"] < label:
        ctx.state.label.update(r["label"])
        ctx.emit({"node": node, "other": -1, "label": r["label"], "kind": OUT})
        for n in ctx.state.neighbours.get():
            ctx.emit({"node": n, "other": node, "label": r["label"], "kind": LABEL})


def build(source: abs.Source, sink: abs.Sink) -> abs.Dataflow:
    flow = abs.Dataflow("components")

    def body(loop: abs.Stream):
        labels = loop.key_by("node").process(
            "propagate", propagate, state=[abs.ValueState("label", pa.int64()), abs.ListState("neighbours", pa.int64())])
        return (labels.filter(lambda r: r["kind"] == LABEL, uid="to-neighbours").key_by("node"),
                labels.filter(lambda r: r["kind"] == OUT, uid="label-changes"))

    flow.source("edges", source).flat_map(both_ways, uid="both-ways").iterate("propagation", body).sink("labels", sink)
    return flow


def components(pairs) -> dict[int, int]:
    """The expected labels (union-find): node -> smallest node of its component."""
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for s, d in pairs:
        a, b = find(s), find(d)
        if a != b:
            parent[max(a, b)] = min(a, b)
    return {x: find(x) for x in parent}


def final_labels(table: pa.Table) -> dict[int, int]:
    out: dict[int, int] = {}
    for r in table.to_pylist():
        out[r["node"]] = min(out.get(r["node"], r["label"]), r["label"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("storage", nargs="?", default=None,
                    help="snapshot root (default: a new temporary directory); its earlier checkpoints are kept")
    ap.add_argument("--nodes", type=int, default=3000)
    ap.add_argument("--edges", type=int, default=2500)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    source = random_edges(args.nodes, args.edges)
    flow = build(source, abs.CollectSink())
    storage = args.storage or tempfile.mkdtemp(prefix="abs-components-")
    result = abs.run(flow, parallelism=args.workers, storage=storage, checkpoint=abs.CheckpointConfig(interval=0.2),
                     restore="fresh")
    got = final_labels(result.collected("labels"))
    pairs = source.build_batch(np.arange(args.edges))
    want = components(zip(pairs.column("src").to_pylist(), pairs.column("dst").to_pylist()))
    print(f"{len(got)} nodes in {len(set(got.values()))} components, {len(result.completed_checkpoints)} checkpoints, "
          f"{'labels right' if got == want else 'LABELS WRONG'}")
    print(f"snapshots: abs-snapshot ls {storage}")


if __name__ == "__main__":
    main()
