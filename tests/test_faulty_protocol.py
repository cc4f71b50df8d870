"""``faulty://`` (storage.testing's fault-injecting file system) is a test tool: importing the
product does not register it; the test suite registers it for itself and for the processes it
starts (tests/conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys

import fsspec
import pytest

from storage.testing import FaultyProtocolFileSystem, register_faulty_protocol

KNOWS_FAULTY = (
    "import abs, storage, recovery\n"
    "from fsspec.registry import known_implementations, registry\n"
    "print('faulty' in registry or 'faulty' in known_implementations)\n"
)


def run_python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def product_only_env() -> dict[str, str]:
    """This environment with PYTHONPATH holding the project's import roots but not the test
    suite's plugin directory."""
    roots = [p for p in sys.path if p and "abs-test-fsspec-" not in p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(roots)}


def test_importing_the_product_does_not_register_faulty():
    assert run_python(KNOWS_FAULTY, product_only_env()) == "False"


def test_processes_the_tests_start_know_faulty_and_open_it(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    code = ("import fsspec\n"
            f"fs, path = fsspec.core.url_to_fs('faulty://{tmp_path}/f', target_protocol='file')\n"
            "print(type(fs).__module__ + '.' + type(fs).__name__, fs.cat_file(path).decode())\n")
    assert run_python(code, dict(os.environ)) == "storage.testing.FaultyProtocolFileSystem x"


def test_this_process_knows_faulty():
    assert fsspec.get_filesystem_class("faulty") is FaultyProtocolFileSystem


def test_register_faulty_protocol_writes_a_plugin_a_fresh_process_finds(tmp_path):
    plugin = register_faulty_protocol(str(tmp_path / "plugin"))
    assert plugin == str(tmp_path / "plugin")
    env = product_only_env()
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], plugin])
    assert run_python(KNOWS_FAULTY, env) == "True"


@pytest.mark.integration
def test_a_local_jobs_workers_open_a_faulty_root(tmp_path):
    import pyarrow as pa

    import abs

    def count(ctx, row):
        ctx.state.n.update((ctx.state.n.value() or 0) + 1)

    flow = abs.Dataflow("faulty-workers")
    flow.source("src", abs.GeneratorSource(400, num_keys=8, num_splits=2, batch_size=100)).key_by("key").process(
        "count", count, state=[abs.ValueState("n", pa.int64())])
    result = abs.run(flow, parallelism=2, storage=f"faulty://{tmp_path}", storage_options={"target_protocol": "file"})
    assert result.status == "FINISHED" and result.last_checkpoint is not None
    from storage import SnapshotStore

    assert SnapshotStore.open(str(tmp_path)).verify().ok
