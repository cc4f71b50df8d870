"""Planning the read of one keyed state at one checkpoint, on the driver: the checkpoint,
the chains of the key groups asked for and the schema of the DataFrame, in a picklable
:class:`_StatePlan` the executors read from."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from abscore.schema import KEY_COLUMN, OP_COLUMN

from .errors import CheckpointNotFoundError, StorageConfigError, StorageError
from .file_ref import FileRef
from .manifest import Manifest
from .spark_options import SOURCE_NAME, _Options
from .spark_partitions import _pack_by_bytes
from .spark_stores import _open_existing
from .spark_types import _encoding, arrow_to_spark_type
from .store import SnapshotStore
from .tables import value_columns

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql.types import StructType

KEY_GROUP_COLUMN = "key_group"


@dataclass
class _StatePlan:
    """Everything the executors need to read one keyed state at one checkpoint (picklable)."""

    root: str
    storage_options: dict[str, Any]
    checkpoint_id: int
    operator: str
    state: str
    chains: list[tuple[int, list[FileRef]]]   # key group -> chain, sorted by key group
    arrow_schema: pa.Schema                    # key + value columns as in the sample file
    encodings: dict[str, str]                  # column -> "arrow" | "pickle"
    schema_from: str                           # where the schema was taken from (for errors)
    key_groups_per_partition: int | None      # None: pack by bytes (auto)

    def spark_schema(self) -> "StructType":
        from pyspark.sql.types import IntegerType, StructField, StructType

        fields = [StructField(KEY_GROUP_COLUMN, IntegerType(), nullable=False)]
        for f in self.arrow_schema:
            where = f"{self.operator}/{self.state} column {f.name!r}"
            fields.append(StructField(f.name, arrow_to_spark_type(f.type, where=where),
                                      nullable=f.name != KEY_COLUMN,
                                      metadata={"abs.encoding": self.encodings[f.name]}))
        return StructType(fields)

    def partition_groups(self) -> list[list[tuple[int, list[FileRef]]]]:
        """Contiguous runs of key groups, one per Spark partition."""
        n = self.key_groups_per_partition
        if n is not None:
            return [self.chains[i:i + n] for i in range(0, len(self.chains), n)]
        return _pack_by_bytes(self.chains)


def _resolve_checkpoint(store: SnapshotStore, opts: _Options) -> Manifest:
    if opts.checkpoint is None:
        latest = store.latest_checkpoint()
        if latest is None:
            raise CheckpointNotFoundError(
                f"{opts.root}: has no complete checkpoint yet (no manifest parses); wait for one, or check the root"
            )
        return store.read_manifest(latest)
    return store.read_manifest(opts.checkpoint)


def _available_states(manifest: Manifest) -> str:
    pairs = [f"{op!r}/{st!r}" for op, states in sorted(manifest.keyed.items()) for st in sorted(states)]
    return ", ".join(pairs) if pairs else "none"


def _plan_state(opts: _Options) -> _StatePlan:
    store = _open_existing(opts)
    manifest = _resolve_checkpoint(store, opts)
    cid = manifest.checkpoint_id
    if opts.operator is None or opts.state is None:
        missing = " and ".join(n for n, v in (("operator", opts.operator), ("state", opts.state)) if v is None)
        raise StorageConfigError(
            f"{opts.root}: checkpoint {cid}: option {missing} missing; keyed states at this checkpoint "
            f"(operator/state): {_available_states(manifest)}; pass .option('operator', UID).option('state', NAME) "
            "or .option('table', 'checkpoints')"
        )
    chains_by_kg = manifest.chains(opts.operator, opts.state)  # StateNotFoundError lists what exists
    if opts.key_groups is not None:
        outside = sorted(kg for kg in opts.key_groups if kg >= manifest.max_parallelism)
        if outside:
            raise StorageConfigError(
                f"{SOURCE_NAME}: option keyGroups names key group(s) {outside[:10]} outside [0, "
                f"{manifest.max_parallelism}) of job {manifest.job_name!r}; fix the option"
            )
        chains_by_kg = {kg: c for kg, c in chains_by_kg.items() if kg in opts.key_groups}
    chains = sorted(chains_by_kg.items())

    schema, schema_from = _sample_schema(store, manifest, opts.operator, opts.state)
    names = [n for n in schema.names if n != OP_COLUMN]
    if KEY_COLUMN not in names:
        raise StorageError(f"{opts.root}: checkpoint {cid}: {schema_from} has no 'key' column (columns {schema.names}); "
                           "the file is not keyed state")
    values = value_columns(schema)
    if KEY_GROUP_COLUMN in values:
        raise StorageError(f"{opts.root}: checkpoint {cid}: {opts.operator}/{opts.state} has a value column named "
                           f"{KEY_GROUP_COLUMN!r}, which this reader adds itself; read it with pyarrow instead")
    arrow_schema = pa.schema([schema.field(KEY_COLUMN)] + [schema.field(v) for v in values],
                             metadata=schema.metadata)
    encodings = {n: _encoding(schema, n) for n in arrow_schema.names}

    per = opts.key_groups_per_partition
    return _StatePlan(root=opts.root, storage_options=opts.storage_options, checkpoint_id=cid,
                      operator=opts.operator, state=opts.state, chains=chains, arrow_schema=arrow_schema,
                      encodings=encodings, schema_from=schema_from, key_groups_per_partition=per)


def _sample_schema(store: SnapshotStore, manifest: Manifest, operator: str, state: str) -> tuple[pa.Schema, str]:
    """Schema of the state's first non-empty file (a base if any has rows), by key group."""
    chains = sorted(manifest.chains(operator, state).items())
    refs = [(kg, ref) for kg, chain in chains for ref in chain]
    picked = (next(((kg, r) for kg, r in refs if r.kind == "base" and r.rows > 0), None)
              or next(((kg, r) for kg, r in refs if r.rows > 0), None)
              or (refs[0] if refs else None))
    if picked is None:  # the state exists but holds no key group: an empty table of pickled keys/values
        return (pa.schema([pa.field(KEY_COLUMN, pa.binary()), pa.field("value", pa.binary())]),
                "the default schema (the state has no key groups)")
    kg, ref = picked
    table = store.read_file(ref, checkpoint_id=manifest.checkpoint_id)
    return table.schema, f"key group {kg} ({ref.path})"
