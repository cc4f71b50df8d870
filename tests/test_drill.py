"""The fault drill (scripts/drill.py): a short run of every fault kind must end with no
schedule lost, duplicated, stuck or failed with restarts left; its schedules are a pure
function of their seed; and its checker does catch lost and duplicated output."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "drill.py"


def _drill_module():
    spec = importlib.util.spec_from_file_location("abs_drill", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


drill = _drill_module()


def test_a_schedule_is_a_pure_function_of_its_seed_and_kind():
    for seed in range(40):
        kind = drill.draw_kind(seed)
        assert kind == drill.draw_kind(seed)
        a = drill.make_schedule(seed, 2, "file", kind)
        b = drill.make_schedule(seed, 2, "file", kind)
        assert a == b
    # the kinds drawn over many seeds cover every kind
    assert {drill.draw_kind(s) for s in range(200)} == set(drill.KINDS)
    # a replay with --kinds KIND gives the details the drill ran with
    for seed in range(40):
        kind = drill.draw_kind(seed)
        assert drill.make_schedule(seed, 2, "file", kind) == drill.make_schedule(
            seed, 2, "file", drill.draw_kind(seed, (kind,)))


@pytest.mark.integration
def test_a_short_drill_of_every_fault_kind_is_exact(tmp_path):
    report = tmp_path / "drill.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--schedules", "10", "--seed", "1", "--cover", "--json", str(report)],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    assert report.exists(), proc.stdout + proc.stderr
    table = json.loads(report.read_text())["table"]
    total = table["total"]
    assert total["schedules"] == 10
    assert {c: total[c] for c in drill.BAD} == {c: 0 for c in drill.BAD}, proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # --cover ran every kind at least once
    assert set(drill.KINDS) <= set(table), proc.stdout


@pytest.mark.integration
def test_the_checker_catches_lost_and_duplicated_output(tmp_path):
    args = drill.parse_args(["--events", "20000", "--duration", "1"])
    d = drill.Drill(args)
    try:
        sch = drill.make_schedule(7, 2, "file", "kill_worker")
        sch.at = 0.2
        assert d.run(sch).cls == "exact"
        sdir = Path(d.base) / f"s{sch.seed}"
        cfg = {"result": str(sdir / "result-0.json")}
        out, root = sdir / "out", str(sdir / "snap")
        parts = sorted(p for p in out.iterdir() if p.name.startswith("part-"))
        assert parts
        # a committed part file written twice: duplicated
        shutil.copy(parts[0], out / ("part-99999999-000-" + "0" * 32 + parts[0].suffix))
        assert d._check(sch, cfg, root, str(out), {}, []).cls == "duplicated"
        # and one missing: lost
        (out / ("part-99999999-000-" + "0" * 32 + parts[0].suffix)).unlink()
        parts[-1].unlink()
        assert d._check(sch, cfg, root, str(out), {}, []).cls == "lost"
    finally:
        d.close()
