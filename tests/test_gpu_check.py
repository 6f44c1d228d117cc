"""`make gpu-check` (bench/gpu_check.py) without a GPU: it refuses and writes nothing, its plan names what exists
and what the scripts accept, its scheduler keeps every budget and the deadline, and its report says what did
not pass. (The check itself needs a GPU machine; none is in CI.)"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from bench import gpu_check as gc
from coursekit.runtime import SHORT_SCHEDULE, SIZES, detect
from helpers import PY, REPO


def test_without_cuda_it_refuses_with_exit_status_2_and_writes_nothing(tmp_path):
    if gc.cuda_available():
        pytest.skip("this machine has a GPU: run make gpu-check")
    for cmd in ([PY, "-m", "bench.gpu_check"], [PY, "-m", "bench", "--only", "gpu", "--out", str(tmp_path)]):
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, (cmd, proc.stdout, proc.stderr)
        assert "no CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert not list(tmp_path.iterdir())                # the bench's results are left as they were


def test_the_plan_covers_every_notebook_the_gpu_scripts_nccl_and_grading():
    tasks = {t.name: t for t in gc.plan()}
    notebooks = sorted(p.stem for p in (REPO / "solutions").glob("[0-9]*/*.ipynb"))
    assert {f"notebook {n}" for n in notebooks} | {"facts", "grading", "script fsdp2 bf16", "script zero3 bf16"} \
        == set(tasks)
    for name, t in tasks.items():
        assert 0 < t.budget_s <= gc.DEADLINE_S, name
        if name.startswith(("notebook", "script")):
            assert t.env == {"COURSE_SIZE": "gpu", "COURSE_SCHEDULE": "short"}, name
    compile(gc.FACTS, "FACTS", "exec")
    assert "nccl" in gc.FACTS and 'init_device_mesh("cuda"' in gc.FACTS and "bfloat16" in gc.FACTS
    # the scripts exist and accept every option the check passes
    for name in ("script fsdp2 bf16", "script zero3 bf16"):
        t = tasks[name]
        script = t.cwd / t.cmd[1]
        assert script.exists(), script
        usage = subprocess.run([PY, str(script), "--help"], capture_output=True, text=True, timeout=120).stdout
        for flag in (a for a in t.cmd[2:] if a.startswith("--")):
            assert flag in usage, f"{script.name} has no {flag}"
        assert "--bf16" in t.cmd and "--use-gpu" in t.cmd and "--metrics-out" in t.cmd


def test_dry_run_prints_the_plan_and_starts_nothing():
    proc = subprocess.run([PY, "-m", "bench.gpu_check", "--dry-run"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert f"12 tasks, {gc.SLOTS} at a time, all within {gc.DEADLINE_S} s" in proc.stdout
    assert "notebook 05_fsdp2" in proc.stdout and "train_ray_deepspeed.py --stage 3 --bf16" in proc.stdout


def test_the_scheduler_keeps_each_budget_and_the_deadline(tmp_path):
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    tasks = [gc.Task("quick", [sys.executable, "-c", "print('ok')"], 20),
             gc.Task("broken", [sys.executable, "-c", "raise SystemExit(3)"], 20),
             gc.Task("slow", sleep, 2),                                   # stopped at its budget
             gc.Task("late", sleep, 20),                                  # stopped at the deadline
             gc.Task("never", [sys.executable, "-c", "print('ok')"], 20)]  # no time left to start
    t0 = time.monotonic()
    rows = {r["task"]: r for r in gc.schedule(tasks, slots=1, deadline_s=12, log_dir=tmp_path, log=lambda m: None)}
    took = time.monotonic() - t0
    assert took < 12 + 10, took
    assert rows["quick"]["verdict"] == "passed" and rows["broken"]["verdict"] == "failed"
    assert "exit status 3" in rows["broken"]["why"]
    assert rows["slow"]["verdict"] == "timeout" and "its budget" in rows["slow"]["why"]
    assert rows["late"]["verdict"] == "timeout" and "the deadline" in rows["late"]["why"]
    assert rows["never"]["verdict"] == "not run"


def test_the_report_gives_a_value_only_to_what_passed(tmp_path):
    rows = [{"task": "facts", "verdict": "passed", "seconds": 9.0, "budget_s": 60, "what": "", "why": "",
             "measured": {"device": "NVIDIA H200", "nccl": "2.27.3"}},
            {"task": "notebook 05_fsdp2", "verdict": "timeout", "seconds": 240.0, "budget_s": 240, "what": "",
             "why": "stopped after 240 s (its budget)", "measured": None}]
    section = gc.report(rows, 250.0, out=tmp_path)
    figures = {f["name"]: f for f in section["figures"]}
    assert figures["facts: passed"]["status"] == "met"
    assert figures["notebook 05_fsdp2: timeout"]["status"] == "not measured"
    assert figures["the whole check"]["value"] == 250.0
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["facts"]["device"] == "NVIDIA H200"
    assert "stopped after 240 s" in (tmp_path / "report.md").read_text()
    from bench.report import TITLES

    assert "gpu" in TITLES


def test_the_short_schedule_keeps_the_models_and_cuts_the_schedule():
    full, short = detect({"COURSE_SIZE": "gpu"}).sizes, detect({"COURSE_SIZE": "gpu", "COURSE_SCHEDULE": "short"}).sizes
    assert full == SIZES["gpu"]
    for key in ("vit_depth", "vit_width", "global_batch_size", "multinode_model"):
        assert short[key] == full[key], key
    for key, cap in SHORT_SCHEDULE.items():
        assert short[key] == min(cap, full[key]) < full[key], key
    with pytest.raises(ValueError, match="COURSE_SCHEDULE"):
        detect({"COURSE_SCHEDULE": "fast"})
