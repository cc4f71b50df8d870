"""Which failures the restart strategy retries (abs.runtime.failures): a pure decision."""
from __future__ import annotations

import errno

import pytest
from hypothesis import given
from hypothesis import strategies as st

import abs
from abs.errors import StateError
from abs.runtime.failures import describe, is_permanent, should_restart
from recovery.errors import CheckpointUnusableError, IncompatibleSnapshotError, NoUsableCheckpointError
from storage.errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    CorruptJobFileError,
    CorruptManifestError,
    JobMismatchError,
    MissingFileError,
    StorageConfigError,
    StorageUnavailableError,
    UnsupportedFormatError,
)

PERMANENT = [
    abs.ConfigError("bad option"), abs.GraphError("cycle"), abs.DuplicateUidError("uid twice"), StateError("type"),
    StorageConfigError("bad url"), JobMismatchError("another job"), UnsupportedFormatError("newer"),
    CheckpointNotFoundError("no 42"), IncompatibleSnapshotError("uid gone"),
    CheckpointUnusableError("42 broken", checkpoint_id=42), NoUsableCheckpointError("none verifies"),
    ModuleNotFoundError("no module named jobcode"), CorruptJobFileError("_job.json: does not parse as JSON"),
    abs.StartupError("worker 1 failed while creating its tasks: ConfigError: x", permanent=True),
]
TRANSIENT = [
    abs.WorkerLostError("worker 1 was killed"), abs.OperatorError("user function raised"),
    abs.StartupError("worker 0 failed while restoring its state: StorageUnavailableError: x"),
    abs.CheckpointFailedError("the final checkpoint failed 5 times"),
    StorageUnavailableError("unreachable"), CorruptFileError("torn"), MissingFileError("gone"),
    CorruptManifestError("_job.json vanished while being checked; retry"),
    OSError(errno.ENOSPC, "No space left on device"), ConnectionRefusedError(), EOFError(), RuntimeError("bug?"),
]
VERDICTS = [abs.JobFailedError("more failed checkpoints than tolerable_failures allows"), KeyboardInterrupt(), SystemExit(1)]


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent_errors_fail_the_job_at_once(exc):
    assert is_permanent(exc) and not should_restart(exc)


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient_failures_of_an_attempt_are_restarted(exc):
    assert not is_permanent(exc) and should_restart(exc)


@pytest.mark.parametrize("exc", VERDICTS, ids=lambda e: type(e).__name__)
def test_the_jobs_own_verdicts_and_interrupts_are_not_restarted(exc):
    assert not should_restart(exc)


@given(st.sampled_from(PERMANENT + TRANSIENT + VERDICTS), st.text(max_size=40))
def test_a_permanent_error_is_never_restarted_and_a_message_never_changes_the_verdict(exc, text):
    same_kind = type(exc).__new__(type(exc))
    same_kind.__dict__.update(exc.__dict__)
    same_kind.args = (text,)
    assert is_permanent(same_kind) == is_permanent(exc) and should_restart(same_kind) == should_restart(exc)
    assert not (is_permanent(exc) and should_restart(exc))


def test_describe_gives_the_type_and_the_first_line():
    assert describe(StorageUnavailableError("s3://b: reading x failed\ndetails")) == \
        "StorageUnavailableError: s3://b: reading x failed"
    assert describe(EOFError()) == "EOFError"


def test_a_corrupt_job_file_fails_the_job_at_once_without_a_restart(tmp_path, capfd):
    """A restart re-reads the same _job.json: the error is the job's answer, at once."""
    import pyarrow as pa

    def count(ctx, row):
        ctx.state.n.update((ctx.state.n.value() or 0) + 1)

    def flow() -> abs.Dataflow:
        f = abs.Dataflow("jobfile")
        f.source("s", abs.GeneratorSource(500, num_keys=10)).key_by("key").process(
            "c", count, state=[abs.ValueState("n", pa.int64())])
        return f

    root = str(tmp_path / "root")
    abs.run(flow(), parallelism=1, storage=root)
    with open(tmp_path / "root" / "_job.json", "w") as f:
        f.write('{"job_name": "jobfile", "max_par')
    capfd.readouterr()
    with pytest.raises(CorruptJobFileError, match="_job.json: does not parse as JSON"):
        abs.run(flow(), parallelism=1, storage=root, restore="latest",
                restart=abs.RestartStrategy(max_restarts=2, delay=0.01))
    assert "restart 1 of 2" not in capfd.readouterr().err
