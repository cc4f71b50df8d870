"""Start-up: what a local job imports (in the driver and in its workers)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

# Extras and heavy modules that a local job never needs: importing any of them costs start-up
# time (pyspark alone: seconds) in the driver and in every worker.
NEVER_LOCAL = ("pyspark", "s3fs", "pandas", "matplotlib", "rich", "prometheus_client", "boto3", "moto")

JOB = textwrap.dedent(
    """
    import json, sys
    import pyarrow as pa
    import abs

    NEVER = {never!r}
    STORAGE = {storage!r}

    def loaded():
        return sorted(m for m in sys.modules if m.split(".")[0] in NEVER or (STORAGE is None and m == "fsspec"))

    def count(ctx, row):
        n = ctx.state.n
        n.update((n.value() or 0) + 1)
        if n.value() == 1:
            ctx.emit({{"key": ctx.key, "modules": json.dumps(loaded())}})

    if __name__ == "__main__":
        flow = abs.Dataflow("imports")
        flow.source("src", abs.GeneratorSource(200, num_keys=10, num_splits=2)).key_by("key").process(
            "count", count, state=[abs.ValueState("n", pa.int64())]).sink("out", abs.CollectSink())
        options = {{}} if STORAGE is None else {{"storage": STORAGE, "checkpoint": abs.CheckpointConfig()}}
        result = abs.run(flow, parallelism=2, **options)
        workers = sorted(set(result.collected("out").column("modules").to_pylist()))
        print(json.dumps({{"driver": loaded(), "workers": workers}}))
    """
)


def _modules_of_a_local_job(tmp_path, storage: str | None) -> dict:
    script = tmp_path / "job.py"
    script.write_text(JOB.format(never=NEVER_LOCAL, storage=storage))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_local_job_imports_no_spark_and_no_extras_in_driver_or_workers(tmp_path):
    seen = _modules_of_a_local_job(tmp_path, str(tmp_path / "root"))
    assert seen["driver"] == [], f"the driver of a local job imported {seen['driver']}"
    assert seen["workers"] == ["[]"], f"the workers of a local job imported {seen['workers']}"


def test_a_job_without_storage_imports_no_file_system_layer(tmp_path):
    seen = _modules_of_a_local_job(tmp_path, None)
    assert seen["driver"] == [], f"the driver of a job without storage imported {seen['driver']}"
    assert seen["workers"] == ["[]"], f"the workers of a job without storage imported {seen['workers']}"
