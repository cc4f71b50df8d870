"""Setting up an attempt of a job in the driver: opening the storage root, resolving what to
restore (falling back past broken checkpoints, see :mod:`abs.runtime.restore`), rolling the
sinks' output back to it, the driver side of the sources, and what each worker owns
(:class:`~abs.runtime.messages.WorkerAssignment`: its source splits and, on a restore,
exactly its part of ``recovery``'s :class:`~recovery.plan.RestorePlan`).

:class:`RestoreSetup` is a part of :class:`~abs.runtime.driver.JobDriver`; it works on the
driver's own attributes (``flow``, ``P``, ``store``, ``restore``, ...).
"""
from __future__ import annotations

import logging
import dataclasses
import re
from typing import Any

from ..errors import ConfigError
from ..connectors.sinks import CollectSink
from . import messages as m
from .restore import SinkView, committed_evidence, id_ranges, plan_output, savepoint_origin

log = logging.getLogger(__name__)

__all__ = ["RESTORE_WORDS", "RestoreSetup", "RestoreState", "collect_key_id"]

RESTORE_WORDS = ("latest", "latest-if-any", "fresh")
"""restore= values that are words, not savepoint paths"""


def short_reason(reason: str) -> str:
    """A skipped checkpoint's reason without its parenthesised details, for the one-line
    restore message ("manifest truncated (...)" -> "manifest truncated"; "file X: file (written
    by checkpoint 11) is missing" -> "file X: file is missing", not cut at the parenthesis)."""
    short = reason
    while True:
        shorter = re.sub(r"\s*\([^()]*\)", "", short)
        if shorter == short:
            break
        short = shorter
    return " ".join(short.split()) or reason.strip()


class RestoreSetup:
    """The set-up steps of :class:`~abs.runtime.driver.JobDriver` (see the module docstring)."""

    def _open_storage(self) -> tuple[int, dict]:
        """Open the store, check the job fingerprint, resolve what to restore."""
        self._follows = None
        if self.storage_url is not None:
            from storage import SnapshotStore

            self.store = SnapshotStore.open(self.storage_url, self.storage_options)
            claimed = self.store.init_job(self.flow.fingerprint())
            if not self.storage_url.startswith("memory://"):  # memory:// is each process's own
                self._probe = self.store.write_probe()  # every worker checks it sees this root
            try:
                return self._resolve_restore()
            except BaseException:
                # refused before anything ran (e.g. restore='latest' on an empty root): leave the
                # root as it was, neither a probe file nor a claim by a job that never started
                self._drop_probe()
                if claimed:
                    from storage.errors import StorageError

                    try:
                        self.store.unclaim_job()
                    except StorageError as exc:
                        log.warning(f"could not remove the _job.json this attempt wrote: {exc}")
                raise
        if self.store is None and self.restore is None:
            return 1, {}
        return self._resolve_restore()

    def _resolve_restore(self) -> tuple[int, dict]:
        """Pick the checkpoint to restore (falling back past broken ones for "latest"; see
        :mod:`abs.runtime.restore` for the options), check it against the job, roll the sinks
        back to it, and plan what every new subtask reads. Returns ``(first id, restore info)``."""
        from recovery import check, plan_restore

        rs = self._restore_state
        evidence, in_root = self._committed_evidence()
        choice, store, url, opts, fresh_why = self._choose(evidence, in_root)
        cid = choice.checkpoint_id if choice is not None else None
        skipped = list(choice.skipped) if choice is not None else []
        for w in (choice.warnings if choice is not None else []):
            log.warning(f"{w}")
        for sk in skipped:
            if all(sk.checkpoint_id != i for i, _ in rs.skipped):
                rs.skipped.append((sk.checkpoint_id, sk.reason))
        manifest = plan = None
        sources = {n.uid: n.spec["source"] for n in self.flow.nodes if n.kind == "source"}
        if cid is not None:
            fingerprint = self.flow.fingerprint()
            check(
                fingerprint, store, checkpoint_id=cid, parallelism=self.P, verify_files=False,
                allow_non_restored_state=self.allow_non_restored_state,
            ).raise_if_fatal()
            manifest = store.read_manifest(cid)
            self._check_loops(manifest)
            plan = plan_restore(
                manifest, fingerprint, self.P,
                source_splits={uid: list(src.splits()) for uid, src in sources.items()},
                allow_non_restored_state=self.allow_non_restored_state,
            )
        # what the sinks must undo: decided before anything is changed, carried out before any worker starts.
        # A savepoint holds the state of the checkpoint it copied, whose id may be lower than its
        # own (a copy of an older checkpoint into this very root, or the later of two savepoints
        # in one directory): the output to undo is what that checkpoint had not committed.
        target = cid if cid is not None else (rs.run_first_id - 1 if rs.started else None)
        origin = savepoint_origin(manifest) if manifest is not None else None
        if origin is not None and origin < target:
            target = origin
        undo = self._plan_output(target, evidence, skipped, cid, url) if target is not None else None
        first_id = max([self.store.next_checkpoint_id() if self.store is not None else 1,
                        (cid or 0) + 1, max(evidence, default=0) + 1])
        if not rs.started:
            rs.started, rs.run_first_id = True, first_id
        job = f"[abs] job {self.flow.name!r}"
        if cid is None:
            log.info(f"{job}: starting fresh ({fresh_why}); first checkpoint id {first_id}")
        else:
            # the short reasons here; the warnings above carry the details
            why = (f" (skipped {'; '.join(f'{sk.checkpoint_id}: {short_reason(sk.reason)}' for sk in skipped)})"
                   if skipped else "")
            copy = f" (a savepoint of checkpoint {origin})" if origin is not None and origin != cid else ""
            log.info(f"{job}: restoring checkpoint {cid}{copy} of {url}{why}")
        if undo is not None:
            self._roll_back_output(*undo)
        if cid is None:
            return first_id, {}
        if manifest.stats.get("parallelism") not in (None, self.P):
            log.info(f"[abs] rescaling checkpoint {cid} from parallelism {manifest.stats.get('parallelism')} "
                     f"to {self.P}")
        self.restored_from = cid
        if self.restarts:
            self.restarts[-1]["restored_from"] = cid
            self.restarts[-1]["skipped"] = [(sk.checkpoint_id, sk.reason) for sk in skipped]
        if url == self.storage_url:
            # new checkpoints build on the restored chains: keep them from GC like a base
            self._manifests[cid] = manifest
            self._last_completed_id = cid
            self._follows = manifest
        return first_id, {"manifest": manifest, "plan": plan, "url": url, "options": opts, "sources": sources}

    def _committed_evidence(self) -> tuple[dict[int, str], bool]:
        """Checkpoint ids known to have committed (see ``restore.committed_evidence``), and
        whether the storage root itself shows any (a manifest file or the commit record)."""
        from storage.errors import CorruptManifestError

        manifest_ids: list[int] = []
        recorded = None
        if self.store is not None:
            manifest_ids = list(self.store.manifest_ids())
            try:
                recorded = self.store.recorded_committed()
            except CorruptManifestError as exc:
                log.warning(f"{exc}; a deleted newest manifest would go unnoticed")
        sink_ids = {n.uid: n.spec["sink"].committed_checkpoints() for n in self.flow.nodes
                    if n.kind == "sink" and n.spec["sink"].supports_rollback}
        evidence = committed_evidence(manifest_ids, recorded, sink_ids, (c.checkpoint_id for c in self.completed))
        return evidence, bool(manifest_ids) or recorded is not None

    def _choose(self, evidence: dict[int, str], in_root: bool) -> tuple[Any, Any, Any, Any, str]:
        """``(choice or None, store, url, options, why fresh)`` for this attempt. Output left in
        a sink counts as a sign of a lost checkpoint only when the root shows checkpoints too
        (``in_root``): a sink's files next to an empty root are another run's."""
        from recovery import RestoreChoice, choose_restore
        from recovery.errors import NoUsableCheckpointError
        from storage import SnapshotStore

        rs, r, store, url = self._restore_state, self.restore, self.store, self.storage_url
        opts = self.storage_options
        known = {cid: why for cid, why in evidence.items() if why != "its manifest exists"
                 and (in_root or rs.started or not why.startswith("sink "))}
        if rs.started:  # a restart: this run's newest checkpoint, else what the run started from
            if rs.origin == "latest":
                choice = choose_restore(store, "latest", allow_empty=True, known_committed=known)
                return choice, store, url, opts, f"restart {self._attempt}: the root holds no checkpoint"
            choice = choose_restore(store, "latest", allow_empty=True, allow_none_usable=True,
                                    known_committed=known, min_id=rs.run_first_id) if store is not None else None
            if choice is not None and choice.checkpoint_id is not None:
                return choice, store, url, opts, ""
            if rs.origin_id is not None:
                o_store = store if rs.origin_url == url else SnapshotStore.open(rs.origin_url, rs.origin_options)
                again = choose_restore(o_store, rs.origin_id)
                return (RestoreChoice(again.checkpoint_id, choice.skipped if choice else (), again.url), o_store,
                        rs.origin_url, rs.origin_options, "")
            return choice, store, url, opts, f"restart {self._attempt}: no checkpoint of this run to restore"
        ids = sorted(i for i, why in evidence.items() if not why.startswith("sink "))  # the root's own
        if r is None or r == "fresh":
            if r is None and in_root:
                raise ConfigError(
                    f"job {self.flow.name!r}: storage root {url} already holds checkpoints of this job (latest id "
                    f"{ids[-1]}); starting without restore= would continue their ids and mix two runs; pass "
                    f"restore='latest' to continue from them, another storage root, or restore='fresh' to start "
                    "from empty state on purpose (new checkpoint ids continue above the existing ones)"
                )
            rs.origin = "fresh"
            why = (f"restore='fresh': {url} holds checkpoints up to {ids[-1]}, new ones continue above" if r == "fresh"
                   and in_root else ("restore='fresh'" if r else "no restore requested") + f"; {url} holds no checkpoint")
            return None, store, url, opts, why
        if r in ("latest", "latest-if-any"):
            if not in_root:
                if r == "latest":
                    raise NoUsableCheckpointError(
                        f"{url}: holds no checkpoint of job {self.flow.name!r}; restore='latest' has nothing to "
                        "restore; check the storage root, or pass restore='latest-if-any' to restore the latest "
                        "checkpoint when there is one and start fresh otherwise"
                    )
                rs.origin = "fresh"
                return None, store, url, opts, f"restore='latest-if-any': {url} holds no checkpoint"
            choice = choose_restore(store, "latest", known_committed=known)
            rs.origin = "latest"
            return choice, store, url, opts, ""
        if isinstance(r, int):
            choice = choose_restore(store, r)
        else:  # a savepoint (or any root) elsewhere: its latest checkpoint. One on the job root's
            # kind of file system (an s3:// savepoint of an s3:// job) is read with the job's
            # storage_options, as SnapshotStore.savepoint writes it with them
            import fsspec.core
            from storage.backend import protocols_of

            same = store is not None and (fsspec.core.split_protocol(r)[0] or "file") in protocols_of(store.fs)
            opts = self.storage_options if same else None
            store, url = SnapshotStore.open(r, opts), r
            choice = choose_restore(store, "latest")
        rs.origin, rs.origin_id, rs.origin_url, rs.origin_options = "exact", choice.checkpoint_id, url, opts
        return choice, store, url, opts, ""

    def _plan_output(self, target: int, evidence: dict[int, str], skipped: list, cid: int | None,
                     url: str | None) -> tuple:
        """What to undo of the output committed above ``target`` (see ``restore.plan_output``);
        raises :class:`RepeatedOutputError` when a sink would repeat output and that is not allowed."""
        from ..errors import RepeatedOutputError

        above = {i: why for i, why in evidence.items() if i > target}
        above.update({sk.checkpoint_id: sk.reason for sk in skipped if sk.checkpoint_id > target})
        for i, why in above.items():
            if why == "its manifest exists":
                above[i] = "newer than the checkpoint restored"
        sinks = [SinkView(n.uid, "collect" if isinstance(n.spec["sink"], CollectSink)
                          else "rollback" if n.spec["sink"].supports_rollback else "none", type(n.spec["sink"]).__name__)
                 for n in self.flow.nodes if n.kind == "sink"]
        out = plan_output(target, above, sinks, (c.checkpoint_id for c in self.completed))
        restoring = f"restoring checkpoint {cid} of {url}" if cid is not None else "starting fresh"
        refusal = out.refusal(self.flow.name, restoring)
        if refusal is not None and not self.allow_repeated_output:
            raise RepeatedOutputError(refusal)
        return out, restoring

    def _roll_back_output(self, out: Any, restoring: str) -> None:
        """Carry out :meth:`_plan_output`'s plan: before any worker starts."""
        target = out.target
        rs = self._restore_state
        job = f"[abs] job {self.flow.name!r}"
        for uid, ids in out.repeated.items():
            rs.repeated.setdefault(uid, set()).update(ids)
            log.warning(f"job {self.flow.name!r}: sink {uid!r} will publish again the output it committed "
                        f"for checkpoint(s) {out.describe(ids)} (allow_repeated_output=True), {restoring}")
        by_uid = {n.uid: n.spec["sink"] for n in self.flow.nodes if n.kind == "sink"}
        for uid in out.rollback:
            done = by_uid[uid].rollback(target)
            if done.checkpoints:
                rs.rolled_back.setdefault(uid, set()).update(done.checkpoints)
                log.info(f"{job}: sink {uid!r}: rolled back {done.items} {done.unit} committed by checkpoint(s) "
                         f"{id_ranges(done.checkpoints)}, {restoring}")
        for uid, ids in out.drop_collected.items():
            kept = [(b, i) for b, i in zip(self._collected.get(uid, []), self._collected_ids.get(uid, [])) if i <= target]
            dropped = len(self._collected.get(uid, [])) - len(kept)
            self._collected[uid] = [b for b, _ in kept]
            self._collected_ids[uid] = [i for _, i in kept]
            self._staged = {k: v for k, v in self._staged.items() if collect_key_id(k) <= target}
            rs.rolled_back.setdefault(uid, set()).update(ids)
            log.info(f"{job}: sink {uid!r}: rolled back {dropped} collected batches of checkpoint(s) {id_ranges(ids)}, "
                     f"{restoring}")

    def _check_loops(self, manifest: Any) -> None:
        """The checkpoint's channel state (loop logs, records an unaligned barrier overtook)
        belongs to operators that head a task of this dataflow, by uid; else it would be lost
        without a word."""
        heads = {self.flow.nodes[t.head].uid for t in self.plan.tasks if not t.is_source}
        lost = sorted({ref.location().task.rpartition("#")[0] for ref in manifest.channel_logs} - heads)
        if lost and not self.allow_non_restored_state:
            raise ConfigError(
                f"checkpoint {manifest.checkpoint_id} holds records in flight into operator(s) {lost} (channel state: "
                f"records circulating in a loop, or overtaken by an unaligned barrier), which dataflow "
                f"{self.flow.name!r} does not have as the head of a task (its iterations: "
                f"{sorted(n.uid for n in self.flow.nodes if n.kind == 'iterate') or 'none'}); keep the operator's uid, "
                "or pass allow_non_restored_state=True to drop those records"
            )

    def _assign_splits(self) -> dict:
        """Fresh start: every split of every source from its initial offset, round robin."""
        out: dict = {}
        for node in self.flow.nodes:
            if node.kind != "source":
                continue
            source = node.spec["source"]
            per_subtask: dict[int, dict] = {s: {} for s in range(self.P)}
            for j, split in enumerate(sorted(source.splits())):
                per_subtask[j % self.P][split] = source.initial_offset(split)
            out[node.uid] = per_subtask
        return out

    def _assignments(self, restore_info: dict) -> list[m.WorkerAssignment]:
        """What each worker owns: its source splits, and on a restore exactly its part of the
        restore plan (its key groups' chains, the sink transactions it re-commits)."""
        plan = restore_info.get("plan")
        if plan is None:
            fresh = self._assign_splits()
            return [m.WorkerAssignment(i, {uid: per_sub.get(i, {}) for uid, per_sub in fresh.items()})
                    for i in range(self.P)]
        sources = restore_info["sources"]
        source_splits = plan.source_assignment(lambda uid, split: sources[uid].initial_offset(split))
        # every keyed operator and state of the checkpoint, with only this worker's chains:
        # a worker without a key group of it still learns that its operator was restored
        names = {uid: tuple(states) for uid, states in restore_info["manifest"].keyed.items()}

        def own(i: int) -> dict:
            chains = plan.keyed_chains(i)
            return {uid: {state: dict(chains.get(uid, {}).get(state, {})) for state in states}
                    for uid, states in names.items()}

        return [m.WorkerAssignment(
            subtask=i,
            source_splits={uid: per_sub.get(i, {}) for uid, per_sub in source_splits.items()},
            keyed_chains=own(i),
            sink_transactions=dict(plan.subtasks[i].sink_transactions) or None,
            # every worker sees every channel file; it replays those of its tasks (abs.runtime.unaligned)
            channel_logs=tuple(restore_info["manifest"].channel_logs),
        ) for i in range(self.P)]

    def _sources(self) -> list:
        return [(n.uid, n.spec["source"]) for n in self.flow.nodes if n.kind == "source"]

    def _open_sources(self, restore_info: dict, attempt: int) -> None:
        """The driver-side part of every source (see ``Source.driver_open``)."""
        from ..connectors.sources import Source, SourceContext

        manifest = restore_info.get("manifest")
        origin = restore_info.get("url") if manifest is not None else None
        if origin == self.storage_url:
            origin = None
        self._opened_sources = []
        # only sources with a driver side of their own need the stored offsets
        wanted = any(type(src).driver_open is not Source.driver_open for _uid, src in self._sources())
        stored = self._stored_manifests() if wanted else None
        for uid, source in self._sources():
            restored = dict(manifest.source_offsets.get(uid, {})) if manifest is not None else None
            source.driver_open(SourceContext(
                uid=uid, job_name=self.flow.name, parallelism=self.P, storage_url=self.storage_url,
                storage_options=self.storage_options, restored_offsets=restored, attempt=attempt,
                retained=self.config.retained,
                stored_offsets=None if stored is None else tuple(
                    dict(m.source_offsets.get(uid, {})) for m in stored if m.kind != "savepoint"),
                pinned_offsets=() if stored is None else tuple(
                    dict(m.source_offsets.get(uid, {})) for m in stored if m.kind == "savepoint"),
                restored_from=origin, restored_from_options=restore_info.get("options") if origin else None,
            ))
            self._opened_sources.append(source)

    def _stored_manifests(self) -> list | None:
        """Every readable manifest of the storage root, oldest first (None without storage)."""
        if self.store is None:
            return None
        out = []
        for cid in self.store.list_checkpoints():
            try:
                out.append(self.store.read_manifest(cid))
            except Exception:  # noqa: BLE001 - an unreadable manifest is never restored
                continue
        return out

    def _close_sources(self) -> None:
        for source in getattr(self, "_opened_sources", []):
            try:
                source.driver_close()
            except Exception as exc:  # noqa: BLE001 - closing never hides the job's own outcome
                log.warning(f"closing source {type(source).__name__} failed: {exc}")
        self._opened_sources = []


@dataclasses.dataclass
class RestoreState:
    """What the driver remembers across the attempts of one run (see ``_resolve_restore``)."""

    started: bool = False
    run_first_id: int = 1  # the first checkpoint id of this run: restarts prefer ids >= it
    origin: str = "fresh"  # what the run started from: "fresh", "latest" or "exact"
    origin_id: int | None = None
    origin_url: str | None = None
    origin_options: dict | None = None
    skipped: list = dataclasses.field(default_factory=list)
    rolled_back: dict = dataclasses.field(default_factory=dict)
    repeated: dict = dataclasses.field(default_factory=dict)


def collect_key_id(key: str) -> int:
    """The checkpoint id a CollectSink transaction key ends with (``uid/subtask/tag/id``)."""
    try:
        return int(str(key).rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return 0
