"""The performance harness (bench/) runs without error in its short mode: every section measured,
every figure a number, RESULTS.md a row per figure with its target and ratio. (The figures themselves
depend on the machine: the full run's RESULTS.md is the measurement, not this test.)"""
import json
import math
import subprocess
import sys

import pytest

from helpers import REPO

SECTIONS = ["notebooks", "fit_cost", "throughput", "data", "grading", "memory", "mutants"]


@pytest.mark.slow
def test_short_benchmark_measures_every_section(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench", "--short", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    results_file, md_file = tmp_path / "results.json", tmp_path / "RESULTS.md"
    assert results_file.exists() and md_file.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(results_file.read_text())
    assert results["mode"] == "short"
    machine = results["machine"]
    for key in ("cpus", "memory_gib", "gpu", "python", "torch", "ray", "deepspeed", "date", "git_commit"):
        assert machine.get(key) not in (None, ""), f"machine lacks {key}: {machine}"
    assert list(results["sections"]) == SECTIONS
    errors = {k: s["error"] for k, s in results["sections"].items() if s["error"]}
    assert not errors, "\n\n".join(f"{k}:\n{e}" for k, e in errors.items())
    md = md_file.read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    for key, section in results["sections"].items():
        assert section["figures"], f"{key} has no figures"
        for f in section["figures"]:
            assert isinstance(f["value"], (int, float)) and math.isfinite(f["value"]), f
            assert f["status"] == "reported" or f["status"] == "met" or f["status"].startswith("missed by"), f
            row = [r for r in rows if r.startswith(f"| {key} | {f['name']} |")]
            assert len(row) == 1, f"RESULTS.md needs one row for {key}/{f['name']}"
            if f["target"] is not None:
                assert isinstance(f["ratio"], float), f
                cells = [c.strip() for c in row[0].strip("|").split("|")]
                assert cells[3] != "-" and float(cells[4]) == pytest.approx(f["ratio"], rel=0.05, abs=0.05), row[0]
    targets = {f["name"] for s in results["sections"].values() for f in s["figures"] if f["target"] is not None}
    assert any("fit()" in n for n in targets) and any("/ torchrun" in n for n in targets)
    assert proc.returncode == 0, proc.stdout[-3000:]
