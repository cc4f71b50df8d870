"""Job fingerprints as recovery reads them.

A fingerprint is the JSON that ``Dataflow.fingerprint()`` returns and that the store keeps
(extended with ``job_name`` and ``format_version``) in ``_job.json``::

    {"name": "counts", "max_parallelism": 128,
     "operators": [{"uid": "events", "kind": "source"},
                   {"uid": "count", "kind": "process",
                    "state": [{"kind": "value", "name": "n", "type": "int64"}]},
                   {"uid": "out", "kind": "sink"}]}

Recovery works on this plain data, never on a ``Dataflow`` object (``recovery`` does not
import ``abs``). A job's own fingerprint is parsed strictly; the one in ``_job.json`` is
informative (FORMAT.md) and parsed leniently: without a well-formed ``operators`` list its
``operators`` is ``None`` and state kinds and types cannot be compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from .errors import FingerprintFormatError

__all__ = ["JobFingerprint", "OperatorFingerprint", "descriptor_types"]

# descriptor keys that are not part of the stored representation's type
_NOT_TYPE_KEYS = frozenset({"name", "kind", "reduce_fn"})


@dataclass(frozen=True)
class OperatorFingerprint:
    """One operator: its uid, its kind (``source``, ``sink``, ``process``, ...) and its declared
    keyed state descriptors by name (``descriptor.to_json()`` dicts)."""

    uid: str
    kind: str
    states: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class JobFingerprint:
    """A parsed fingerprint; ``operators`` is ``None`` when unknown (lenient parse)."""

    name: str | None
    max_parallelism: int | None
    operators: dict[str, OperatorFingerprint] | None
    format_version: int | None = None

    @classmethod
    def parse(cls, doc: "Mapping[str, Any] | JobFingerprint", *, source: str = "job fingerprint",
              strict: bool = True) -> "JobFingerprint":
        """Parse a fingerprint dict. ``strict`` raises :class:`FingerprintFormatError` on any
        malformed part; lenient parsing keeps what is well formed."""
        if isinstance(doc, JobFingerprint):
            return doc
        if not isinstance(doc, Mapping):
            raise FingerprintFormatError(
                f"{source}: expected a JSON object, got {type(doc).__name__}; pass Dataflow.fingerprint()"
            )
        name = doc.get("name", doc.get("job_name"))
        max_par = doc.get("max_parallelism")
        version = doc.get("format_version")
        if not (isinstance(name, str) and name):
            if strict:
                raise FingerprintFormatError(f"{source}: lacks a 'name' string; pass Dataflow.fingerprint()")
            name = None
        if not (type(max_par) is int and max_par >= 1):
            if strict:
                raise FingerprintFormatError(
                    f"{source}: max_parallelism={max_par!r} is not an integer >= 1; pass Dataflow.fingerprint()"
                )
            max_par = None
        if type(version) is not int:
            version = None
        try:
            operators = _parse_operators(doc.get("operators"), source)
        except FingerprintFormatError:
            if strict:
                raise
            operators = None
        return cls(name=name, max_parallelism=max_par, operators=operators, format_version=version)


def _parse_operators(raw: Any, source: str) -> dict[str, OperatorFingerprint]:
    if not isinstance(raw, list):
        raise FingerprintFormatError(f"{source}: 'operators' is not a list; pass Dataflow.fingerprint()")
    out: dict[str, OperatorFingerprint] = {}
    for entry in raw:
        if not isinstance(entry, Mapping) or not isinstance(entry.get("uid"), str) or not isinstance(entry.get("kind"), str):
            raise FingerprintFormatError(
                f"{source}: operator entry {entry!r} lacks a 'uid' or 'kind' string; pass Dataflow.fingerprint()"
            )
        uid = entry["uid"]
        if uid in out:
            raise FingerprintFormatError(f"{source}: operator uid {uid!r} appears twice; uids must be unique")
        states: dict[str, dict[str, Any]] = {}
        raw_states = entry.get("state") or []
        if not isinstance(raw_states, list):
            raise FingerprintFormatError(f"{source}: operator {uid!r}: 'state' is not a list of descriptors")
        for desc in raw_states:
            if not isinstance(desc, Mapping) or not isinstance(desc.get("name"), str) or not isinstance(desc.get("kind"), str):
                raise FingerprintFormatError(
                    f"{source}: operator {uid!r}: state descriptor {desc!r} lacks a 'name' or 'kind' string"
                )
            if desc["name"] in states:
                raise FingerprintFormatError(f"{source}: operator {uid!r} declares state {desc['name']!r} twice")
            states[desc["name"]] = dict(desc)
        out[uid] = OperatorFingerprint(uid=uid, kind=entry["kind"], states=states)
    return out


def descriptor_types(descriptor: Mapping[str, Any]) -> dict[str, Any]:
    """The type part of a state descriptor (``type``, ``element_type``, ``key_type``,
    ``value_type``...): every key except ``name``, ``kind`` and ``reduce_fn``."""
    return {k: v for k, v in descriptor.items() if k not in _NOT_TYPE_KEYS}
