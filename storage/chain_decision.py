"""What a checkpoint writes for one key group: the chain decision, a pure function.

:meth:`SnapshotStore.write_key_group` asks :func:`decide_chain` what to do with a capture
given the key group's current chain, and carries the answer out (reading, encoding,
writing). Some facts cost work to learn (the encoded size of the delta or of a values image,
the writer's full image), so the decision may answer with a :class:`NeedFact` first: the
caller learns that fact, adds it to the :class:`CaptureFacts` and asks again. Facts are asked
for in the order the cheapest path needs them, so no work is done that the outcome does not
use. No I/O here.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Sequence

from .chains import CompactionPolicy, compaction_reason_of_sizes
from .manifest import FileRef

__all__ = ["CaptureFacts", "ChainAction", "ChainDecision", "ChainFacts", "Fact", "NeedFact", "decide_chain"]


class ChainAction(enum.Enum):
    """What a checkpoint does with a key group's chain."""

    KEEP = "keep"
    """Write nothing; the chain stays as it is (an empty delta)."""
    DROP = "drop"
    """Write nothing; the chain becomes empty (a full image without rows)."""
    BASE = "base"
    """Write the capture's live rows as a new base (the first capture, or a full image)."""
    VALUES_IMAGE = "values_image"
    """Write the capture's values alone over the chain's base (format 4)."""
    DELTA = "delta"
    """Append the capture as a delta."""
    COMPACT_FROM_IMAGE = "compact_from_image"
    """Compact: write the writer's full image as the new base."""
    COMPACT_BY_READING = "compact_by_reading"
    """Compact: read the chain back, fold the capture in, write the result as the new base."""


class Fact(enum.Enum):
    """A fact about the capture that costs work to learn."""

    VALUES_IMAGE = "values_image"
    """Whether the capture makes a values image, and its encoded bytes."""
    DELTA_BYTES = "delta_bytes"
    """The encoded bytes of the capture as a delta."""
    IMAGE = "image"
    """Whether the writer has the key group's full image (calling for it)."""


@dataclass(frozen=True)
class ChainFacts:
    """The key group's current chain: the bytes of its files (base first), the rows of its
    base, and whether its base is the one the capture's keys are guaranteed to equal."""

    file_bytes: tuple[int, ...] = ()
    base_rows: int = 0
    base_is_over_base: bool = False

    @classmethod
    def of(cls, chain: Sequence[FileRef], over_base: FileRef | None = None) -> "ChainFacts":
        return cls(tuple(ref.bytes for ref in chain), chain[0].rows if chain else 0,
                   bool(chain) and over_base is not None and chain[0] == over_base)

    @property
    def length(self) -> int:
        return len(self.file_bytes)


@dataclass(frozen=True)
class CaptureFacts:
    """The capture of one key group at one checkpoint.

    ``rows``: rows of the captured table; ``complete``: it holds every live key as an upsert
    (a full image); ``over_base``: the writer guarantees its keys are those of a base
    (:class:`ChainFacts` says whether that base heads the chain); ``has_image``: the writer
    can produce the full image on request. The other fields are learnt on request
    (:class:`NeedFact`): ``None`` until then.
    """

    rows: int
    complete: bool = False
    over_base: bool = False
    has_image: bool = False
    values_image_bytes: int | None = None
    values_image_fits: bool | None = None
    delta_bytes: int | None = None
    image_exists: bool | None = None

    def learn(self, fact: "Fact", value: "int | bool | None") -> "CaptureFacts":
        """These facts plus ``fact``: for :attr:`Fact.VALUES_IMAGE` the encoded bytes or
        ``None`` when the capture makes no values image; for :attr:`Fact.DELTA_BYTES` the
        bytes; for :attr:`Fact.IMAGE` whether the image exists."""
        if fact is Fact.VALUES_IMAGE:
            return dataclasses.replace(self, values_image_fits=value is not None, values_image_bytes=value)
        if fact is Fact.DELTA_BYTES:
            return dataclasses.replace(self, delta_bytes=value)
        return dataclasses.replace(self, image_exists=bool(value))


@dataclass(frozen=True)
class NeedFact:
    """The decision needs ``fact`` first (see :meth:`CaptureFacts.learn`)."""

    fact: Fact


@dataclass(frozen=True)
class ChainDecision:
    """What to write. The new chain is the first ``keep`` files of the current chain, then the
    written file (none for :attr:`ChainAction.KEEP` and :attr:`ChainAction.DROP`, where
    ``keep`` is the whole chain or 0). ``reason``: why the chain is compacted, if it is."""

    action: ChainAction
    keep: int = 0
    reason: str | None = None

    @property
    def writes(self) -> bool:
        return self.action not in (ChainAction.KEEP, ChainAction.DROP)

    @property
    def kind(self) -> str:
        """The kind of the written file: ``"delta"`` (a delta or a values image) or ``"base"``."""
        return "delta" if self.action in (ChainAction.DELTA, ChainAction.VALUES_IMAGE) else "base"


def decide_chain(policy: CompactionPolicy, chain: ChainFacts, capture: CaptureFacts) -> "ChainDecision | NeedFact":
    """What to write for ``capture`` over ``chain`` under ``policy``, or the fact needed first.

    In order: a full image over the chain's unchanged base is a values image when the policy
    accepts the pair; the first capture and a full image with rows are a new base; a full
    image without rows empties the chain; an empty delta keeps it. Otherwise the capture is
    appended as a delta unless the policy compacts the chain, which then restarts at a new
    base from the writer's full image when it has one, else from reading the chain back. When
    the writer has an image and the delta's size estimated from the base's bytes per row
    already compacts, the delta is not encoded at all.
    """
    sizes = chain.file_bytes
    if capture.complete and capture.over_base and chain.base_is_over_base and capture.rows == chain.base_rows:
        if capture.values_image_fits is None:
            return NeedFact(Fact.VALUES_IMAGE)
        if capture.values_image_fits and compaction_reason_of_sizes(
                policy, sizes[:1], capture.values_image_bytes or 0) is None:
            return ChainDecision(ChainAction.VALUES_IMAGE, keep=1)
    if not sizes or (capture.complete and capture.rows):
        return ChainDecision(ChainAction.BASE)
    if capture.complete:
        return ChainDecision(ChainAction.DROP)
    if capture.rows == 0:
        return ChainDecision(ChainAction.KEEP, keep=len(sizes))
    if capture.has_image and chain.base_rows:
        estimate = sizes[0] * capture.rows // chain.base_rows
        reason = compaction_reason_of_sizes(policy, sizes, estimate)
        if reason is not None:
            if capture.image_exists is None:
                return NeedFact(Fact.IMAGE)
            if capture.image_exists:
                return ChainDecision(ChainAction.COMPACT_FROM_IMAGE, reason=f"{reason} (estimated)")
    if capture.delta_bytes is None:
        return NeedFact(Fact.DELTA_BYTES)
    reason = compaction_reason_of_sizes(policy, sizes, capture.delta_bytes)
    if reason is None:
        return ChainDecision(ChainAction.DELTA, keep=len(sizes))
    if capture.has_image and capture.image_exists is None:
        return NeedFact(Fact.IMAGE)
    if capture.image_exists:
        return ChainDecision(ChainAction.COMPACT_FROM_IMAGE, reason=reason)
    return ChainDecision(ChainAction.COMPACT_BY_READING, reason=reason)
