"""The GPU path in one command: ``make gpu-check`` (``python -m bench --only gpu``) on one GPU machine.

    python -m bench.gpu_check --dry-run     # the plan: every task, its command and its budget; starts nothing
    make gpu-check                          # run it (refuses, exit status 2, where torch sees no CUDA device)

Made for a machine of one or more NVIDIA GPUs and about 16 cores, and for at most 8 minutes (``DEADLINE_S``):

- ``facts``: the GPUs, CUDA, NCCL and bf16 as torch sees them; a NCCL process group of one rank per GPU
  (an all-reduce checked against its sum) with a CUDA device mesh; a bf16 matmul; peak memory;
- every solution notebook at the ``gpu`` size (the ViT-Large-like model of 05-07, full-width batches) with
  ``COURSE_SCHEDULE=short`` (fewer samples, epochs and trials), with the GPUs visible: NCCL, CUDA meshes,
  DeepSpeed on the GPU; each notebook's own checks (losses fall, accuracy beats chance) decide pass or fail;
- module 07's FSDP2 and ZeRO-3 scripts with ``--bf16`` on the GPUs, their per-rank memory from ``--metrics-out``;
- grading of the reference solution of every module (the grader's jail, the smoke size, CPU).

The tasks run ``SLOTS`` at a time, in ``ORDER``; each stops at its budget or at the deadline, whichever
comes first, and a task with no time left is reported as not run: the check never runs past ``DEADLINE_S``.
The report goes to ``build/gpu_check/report.json`` and ``report.md`` (logs beside them), and into
``bench/results.json`` / ``bench/RESULTS.md`` as the ``gpu`` section (one figure per task: its seconds against
its budget, and what it measured).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from coursekit.paths import REPO

DEADLINE_S = 480            # the whole check, start to report
SLOTS = 5                   # tasks at once: 16 cores, one GPU shared (about 5 GiB per notebook at the gpu size)
OUT = REPO / "build" / "gpu_check"
NOTEBOOK_BUDGET_S = 240
SCRIPT_BUDGET_S = 150
GRADING_BUDGET_S = 300
FACTS_BUDGET_S = 60
NO_CUDA = ("gpu-check: torch sees no CUDA device here (torch.cuda.is_available() is False). It runs on a GPU "
           "machine; `python -m bench.gpu_check --dry-run` shows what it would run.")

FACTS = r'''
import json, os, sys, torch
import torch.distributed as dist
import torch.multiprocessing as mp
from coursekit.distributed import free_port


def rank(r, n, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(r)
    dist.init_process_group("nccl", rank=r, world_size=n, device_id=torch.device("cuda", r))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cuda", (n,), mesh_dim_names=("dp",))
    t = torch.full((1 << 20,), float(r + 1), device="cuda")
    dist.all_reduce(t, group=mesh.get_group("dp"))
    torch.cuda.synchronize()
    if r == 0:
        json.dump({"nccl_all_reduce_ok": bool((t == n * (n + 1) / 2).all()), "mesh": str(mesh)}, open(out, "w"))
    dist.destroy_process_group()


n = torch.cuda.device_count()
p = torch.cuda.get_device_properties(0)
facts = {"gpus": n, "device": torch.cuda.get_device_name(0), "capability": f"{p.major}.{p.minor}",
         "memory_gib": round(p.total_memory / 2**30, 1),
         "torch": torch.__version__, "cuda": torch.version.cuda,
         "nccl": ".".join(map(str, torch.cuda.nccl.version())), "bf16_supported": torch.cuda.is_bf16_supported()}
out = sys.argv[1] + ".nccl.json"
mp.spawn(rank, args=(n, free_port(), out), nprocs=n, join=True)
facts.update(json.load(open(out)))
torch.cuda.reset_peak_memory_stats()
x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
y = x @ x
torch.cuda.synchronize()
facts["bf16_matmul_finite"] = bool(torch.isfinite(y).all())
facts["bf16_matmul_peak_mib"] = round(torch.cuda.max_memory_allocated() / 2**20)
json.dump(facts, open(sys.argv[1], "w"), indent=1)
ok = facts["nccl_all_reduce_ok"] and facts["bf16_matmul_finite"]
print(json.dumps(facts))
sys.exit(0 if ok else 1)
'''


@dataclasses.dataclass
class Task:
    name: str
    cmd: list[str]
    budget_s: float
    env: dict = dataclasses.field(default_factory=dict)
    cwd: Path = REPO
    result: Path | None = None     # a JSON file the task writes (facts, metrics, grades)
    what: str = ""


# the order tasks start in: what the GPU path rests on first, then the GPU-heavy modules, then the rest
ORDER = ["facts", "grading", "notebook 05_fsdp2", "notebook 05_fsdp2_part2", "notebook 06_deepspeed",
         "notebook 07_scaling_up", "script fsdp2 bf16", "script zero3 bf16"]


def plan(out: Path = OUT) -> list[Task]:
    """Every task of the check, in the order they start (ORDER, then the other notebooks)."""
    from coursekit.notebooks import find_notebooks

    py = sys.executable
    gpu = {"COURSE_SIZE": "gpu", "COURSE_SCHEDULE": "short"}
    tasks = [Task("grading", [py, "-m", "bench.gpu_check", "--grade-reference", str(out / "grading")],
                  GRADING_BUDGET_S, result=out / "grading" / "grades.json",
                  what="the reference solution of every module through the grader (jail, smoke size, CPU): full marks")]
    for nb in find_notebooks(REPO / "solutions"):
        dest = out / "notebooks" / nb.name
        tasks.append(Task(f"notebook {nb.stem}", [py, "-m", "bench.gpu_check", "--notebook", str(nb), str(dest)],
                          NOTEBOOK_BUDGET_S, env=gpu, result=dest.with_suffix(".run.json"),
                          what=f"{nb.name} at the gpu size, short schedule, GPUs visible: its own checks pass"))
    scripts = REPO / "solutions" / "07_scaling_up"
    for name, args in (("fsdp2 bf16", ["train_ray_fsdp2.py", "--bf16", "--no-checkpoints"]),
                       ("zero3 bf16", ["train_ray_deepspeed.py", "--stage", "3", "--bf16"])):
        metrics = out / "scripts" / f"{name.replace(' ', '_')}.json"
        tasks.append(Task(f"script {name}", [py, *args, "--use-gpu", "--epochs", "1", "--metrics-out", str(metrics)],
                          SCRIPT_BUDGET_S, env=gpu, cwd=scripts, result=metrics,
                          what=f"07's {' '.join(args)} on the GPUs: per-rank memory and samples/s"))
    tasks.append(Task("facts", [py, "-c", FACTS, str(out / "facts.json")], FACTS_BUDGET_S,
                      result=out / "facts.json", what="GPUs, CUDA, NCCL all-reduce on a CUDA mesh, bf16 matmul"))
    return sorted(tasks, key=lambda t: (ORDER.index(t.name) if t.name in ORDER else len(ORDER), t.name))


def schedule(tasks: list[Task], slots: int = SLOTS, deadline_s: float = DEADLINE_S, log_dir: Path = OUT,
             log=print) -> list[dict]:
    """Run ``tasks`` ``slots`` at a time; each stops at its budget or at the deadline. One row per task."""
    log_dir.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()

    def run(task: Task) -> dict:
        left = deadline_s - (time.monotonic() - start)
        row = {"task": task.name, "budget_s": task.budget_s, "what": task.what, "command": " ".join(task.cmd)}
        if left < 5:
            return {**row, "verdict": "not run", "seconds": 0.0, "why": "no time left before the deadline"}
        limit = min(task.budget_s, left)
        logfile = log_dir / f"{task.name.replace(' ', '_')}.log"
        t0 = time.monotonic()
        with open(logfile, "w") as f:
            proc = subprocess.Popen(task.cmd, cwd=task.cwd, env={**os.environ, **task.env}, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                from coursekit.proctree import kill_tree

                kill_tree(proc.pid)
                proc.wait(timeout=60)
                code = None
        seconds = round(time.monotonic() - t0, 1)
        tail = logfile.read_text(errors="replace")[-1500:]
        if code is None:
            verdict, why = "timeout", f"stopped after {limit:.0f} s ({'its budget' if limit == task.budget_s else 'the deadline'})"
        elif code:
            verdict, why = "failed", f"exit status {code}"
        else:
            verdict, why = "passed", ""
        measured = None
        if task.result and task.result.exists():
            try:
                measured = json.loads(task.result.read_text())
            except ValueError:
                measured = None
        log(f"[gpu-check] {task.name}: {verdict} in {seconds} s {why}")
        return {**row, "verdict": verdict, "seconds": seconds, "why": why, "log": str(logfile),
                "log_tail": tail if verdict != "passed" else "", "measured": measured}

    with concurrent.futures.ThreadPoolExecutor(slots) as pool:
        return list(pool.map(run, tasks))


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def report(rows: list[dict], total_s: float, out: Path = OUT) -> dict:
    """The report (build/gpu_check/report.json, report.md) and the bench section built from it."""
    from bench.report import figure

    out.mkdir(parents=True, exist_ok=True)
    facts = next((r["measured"] for r in rows if r["task"] == "facts" and r["measured"]), None)
    figures = [figure("the whole check", total_s, "s", DEADLINE_S)]
    table = ["| task | verdict | seconds | budget (s) | what it measured |", "|---|---|---|---|---|"]
    for r in rows:
        figures.append(figure(f"{r['task']}: {r['verdict']}", r["seconds"] if r["verdict"] == "passed" else None,
                              "s", r["budget_s"], note=r.get("why", "")))
        table.append(f"| {r['task']} | {r['verdict']} {r.get('why', '')} | {r['seconds']} | {r['budget_s']:.0f} | "
                     f"{_summary(r)} |")
    section = {"figures": figures, "table": table, "facts": facts, "rows": rows,
               "how": "`make gpu-check` (bench/gpu_check.py): every notebook at the gpu size with a short schedule, "
                      "module 07's FSDP2 and ZeRO-3 scripts in bf16, NCCL on a CUDA mesh and grading of the "
                      f"reference, {SLOTS} tasks at a time within {DEADLINE_S} s. A task that did not pass has no "
                      "value (its row says why)."}
    failed = [r["task"] for r in rows if r["verdict"] != "passed"]
    section["notes"] = ([f"did not pass: {', '.join(failed)} (logs in build/gpu_check/)"] if failed else []) + \
        [f"{k}: {v}" for k, v in (facts or {}).items()]
    (out / "report.json").write_text(json.dumps({"total_s": total_s, **section}, indent=1, default=str))
    (out / "report.md").write_text("\n".join(["# GPU check", "", *table, "", *section.get("notes", [])]) + "\n")
    return section


def _summary(row: dict) -> str:
    m = row.get("measured")
    if not isinstance(m, dict):
        return "-"
    keys = ("device", "nccl", "bf16_supported",                   # facts
            "wall_s", "peak_pss_mib",                               # a notebook's run (coursekit.notebooks.execute)
            "samples_per_s", "test_accuracy", "memory_by_rank",     # a script's --metrics-out
            "scores")                                               # grading
    return "; ".join(f"{k}={str(m[k])[:80]}" for k in keys if k in m) or "-"


def gpu_section(ctx: dict | None = None) -> dict:
    """The bench's ``gpu`` section (``python -m bench --only gpu``); raises where there is no CUDA device."""
    if not cuda_available():
        raise RuntimeError(NO_CUDA)
    t0 = time.monotonic()
    rows = schedule(plan())
    return report(rows, round(time.monotonic() - t0, 1))


# ---------------------------------------------------------------- the tasks that are functions of this module

def run_notebook(notebook: Path, dest: Path) -> int:
    from coursekit.notebooks import execute

    r = execute(notebook, dest, env={"COURSE_SIZE": "gpu", "COURSE_SCHEDULE": "short"}, cpu_only=False,
                timeout_s=NOTEBOOK_BUDGET_S)
    dest.with_suffix(".run.json").write_text(json.dumps(r, indent=1))
    return 0 if r["returncode"] == 0 else 1


def grade_reference(out: Path) -> int:
    """Every module's reference solution graded (one student, ``ada``); full marks or exit status 1."""
    import csv
    import shutil

    from autograder.release import modules
    from autograder.samples import solution_answers, write_submission

    shutil.rmtree(out, ignore_errors=True)
    subs = out / "submissions"
    for m in modules():
        write_submission(subs, "ada", m, solution_answers(m))
    proc = subprocess.run([sys.executable, "-m", "autograder.grade", str(subs), "--out", str(out / "graded"),
                           "--jobs", "4", "--quiet", "--no-feedback"], cwd=REPO)
    with open(out / "graded" / "grades.csv") as f:
        rows = list(csv.DictReader(f))
    scores = {r["module"]: f"{r['score']}/{r['max_score']}" for r in rows}
    (out / "grades.json").write_text(json.dumps({"scores": scores}, indent=1))
    full = all(r["status"] == "graded" and float(r["score"]) == float(r["max_score"]) for r in rows)
    return 0 if proc.returncode == 0 and full and len(rows) == len(modules()) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dry-run", action="store_true", help="print the plan and start nothing")
    p.add_argument("--notebook", nargs=2, type=Path, metavar=("NOTEBOOK", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--grade-reference", type=Path, metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.notebook:
        return run_notebook(*args.notebook)
    if args.grade_reference:
        return grade_reference(args.grade_reference)
    tasks = plan()
    if args.dry_run:
        for t in tasks:
            cmd = " ".join("<FACTS in bench/gpu_check.py>" if a == FACTS else a for a in t.cmd)
            print(f"{t.name:28s} budget {t.budget_s:4.0f} s  {cmd}")
        print(f"{len(tasks)} tasks, {SLOTS} at a time, all within {DEADLINE_S} s")
        return 0
    if not cuda_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    from bench.__main__ import main as bench_main

    return bench_main(["--only", "gpu"])


if __name__ == "__main__":
    sys.exit(main())
