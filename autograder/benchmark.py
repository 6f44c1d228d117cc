"""Grading speed: seconds per submission per module, submissions per minute locally and on a Ray cluster, the
fixed cost each submission pays outside nbgrader's autograde, and what a class would take.

    python -m autograder.benchmark [--students 2] [--jobs 1,2] [--cluster-nodes 2] [--modules ...]
                                   [--fixed-repeats 3] [--class-size 300] [--node-cpus 8]
                                   [--out build/grading-bench] [--json FILE]

Writes ``--students`` submissions of every module (alternately the reference solution and the untouched
notebook, the two ends of the work a grader does), then grades the same submissions once per value of
``--jobs`` on this machine and, with ``--cluster-nodes N``, once on a local Ray cluster of N one-CPU nodes
(``coursekit.elastic.LocalCluster``: each node a raylet of its own, the submissions shipped to the tasks as on a
real cluster). Each run starts from an empty output folder, so every submission is graded. It prints, for each
run, the submissions per minute (graded submissions / the seconds from the first job to the last) and per module
the mean seconds of a submission's own process and its fixed cost (``fixed_s``: the process's seconds outside
nbgrader's autograde: starting it, the feedback page). Before those runs, the fixed cost of one untouched
notebook is timed started both ways, a fresh ``python -m autograder.worker`` process per job and a fork of a warm
worker (with and without the feedback page), alternately. Then the extrapolation to ``--class-size``
students on nodes of ``--node-cpus`` CPUs, with its assumptions. Run it on an otherwise idle machine: it is not a
test, its numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from autograder.grade import grade
from autograder.paths import REPO, modules
from autograder.samples import solution_answers, write_submission


def _run(subs: Path, out: Path, ms: list[str], **options) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    rows = grade(subs, out, only=ms, quiet=True, **options)
    wall = time.perf_counter() - start
    report = json.loads((out / "timings.json").read_text())
    graded = [r for r in rows if r["status"] in ("graded", "tests modified")]
    return {"submissions": len(graded), "wall_s": round(wall, 1), "jobs_wall_s": report["jobs_wall_s"],
            "per_minute": round(60 * len(graded) / report["jobs_wall_s"], 2) if report["jobs_wall_s"] else None,
            "modules": report["seconds_per_submission"],
            "not_graded": [f"{r['student']}/{r['module']}: {r['status']}" for r in rows if r not in graded]}


def fixed_cost(subs: Path, out: Path, module: str, repeats: int) -> dict:
    """Each job's seconds outside nbgrader's autograde, for the same notebook (the untouched one) graded ``repeats`` times by
    a fresh ``python -m autograder.worker`` process (as every job was started before warm workers) and by a fork of
    a warm worker, alternately (so that both see the same load); with and without the feedback page."""
    import tempfile

    from autograder.collect import collect
    from autograder.grade import prepare
    from autograder.job import run_job

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    found = sorted((f for f in collect(subs, out, modules())[0] if f.module == module),
                   key=lambda f: f.student != "student01")     # the untouched notebook where there is one
    template = prepare(out, [module])[module]
    seconds: dict[str, list[float]] = {"fresh process": [], "warm worker": [], "warm worker, --no-feedback": []}
    modes = {"fresh process": (False, True), "warm worker": (True, True), "warm worker, --no-feedback": (True, False)}
    base = Path(tempfile.mkdtemp(prefix="course-grading-bench-"))
    try:
        for _ in range(repeats):
            for name, (warm, feedback) in modes.items():
                run = run_job(found[0], template, base, [], 900, 8 * 2**30, feedback=feedback, warm=warm)
                if run["result"].get("autograde_seconds") is not None:
                    seconds[name].append(run["outcome"].seconds - run["result"]["autograde_seconds"])
                shutil.rmtree(run["job"], ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {name: round(sorted(v)[len(v) // 2], 2) if v else None for name, v in seconds.items()}


def extrapolate(per_student_s: float, class_size: int, nodes: int, node_cpus: int) -> float:
    """Minutes to grade ``class_size`` students on ``nodes`` nodes of ``node_cpus`` CPUs, one submission per CPU
    at a time, each taking the seconds it took here with one job per CPU (``per_student_s``: all modules of one
    student)."""
    return class_size * per_student_s / (nodes * node_cpus) / 60


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--students", type=int, default=2)
    p.add_argument("--jobs", default="1,2", help="comma-separated: one local run per value")
    p.add_argument("--cluster-nodes", type=int, default=0, help="also grade on a local Ray cluster of N nodes")
    p.add_argument("--class-size", type=int, default=300)
    p.add_argument("--node-cpus", type=int, default=8)
    p.add_argument("--modules", default=None, help="comma-separated (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "grading-bench")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    p.add_argument("--fixed-repeats", type=int, default=3,
                   help="times each way of starting a job is timed for the fixed cost (0: skip)")
    args = p.parse_args(argv)
    ms = args.modules.split(",") if args.modules else modules()
    shutil.rmtree(args.out, ignore_errors=True)
    subs = args.out / "submissions"
    for i in range(args.students):
        for m in ms:
            write_submission(subs, f"student{i:02d}", m, solution_answers(m) if i % 2 == 0 else {})
    fixed = fixed_cost(subs, args.out / "fixed", ms[0], args.fixed_repeats) if args.fixed_repeats else {}
    runs = {}
    for jobs in [int(j) for j in args.jobs.split(",") if j]:
        runs[f"local, --jobs {jobs}"] = _run(subs, args.out / f"jobs{jobs}", ms, jobs=jobs, timeout=900)
    if args.cluster_nodes:
        from coursekit.elastic import LocalCluster

        with LocalCluster(worker_nodes=args.cluster_nodes - 1, cpus_per_node=1) as cluster:
            runs[f"Ray cluster, {args.cluster_nodes} nodes x 1 CPU"] = _run(
                subs, args.out / "cluster", ms, timeout=900, memory=4 * 2**30, address=cluster.address)

    print(f"\n{'run':<34} {'submissions':>11} {'s, first job to last':>21} {'per minute':>11}")
    for name, r in runs.items():
        print(f"{name:<34} {r['submissions']:>11} {r['jobs_wall_s']:>21.1f} {r['per_minute'] or 0:>11.2f}")
    print(f"\n{'module':<22} " + " ".join(f"{name[:26]:>27}" for name in runs))
    for m in ms:
        cells = []
        for r in runs.values():
            t = r["modules"].get(m)
            cells.append(f"{t['mean_s']:>7.1f} s, fixed {t['mean_fixed_s'] or 0:>4.2f} s" if t else "-")
        print(f"{m:<22} " + " ".join(f"{c:>27}" for c in cells))
    # one job per CPU: the run whose jobs equal this machine's CPUs (or the last local run)
    import os

    local = [r for name, r in runs.items() if name.startswith("local")]
    ref = next((r for name, r in runs.items() if name == f"local, --jobs {os.cpu_count()}"), local[-1] if local else None)
    if fixed:
        print(f"\nFixed cost of a job outside nbgrader's autograde ({ms[0]}, untouched notebook, median of "
              f"{args.fixed_repeats}): " + ", ".join(f"{k} {v} s" for k, v in fixed.items()))
    summary = {"runs": runs, "fixed_cost_s": fixed, "class_size": args.class_size, "node_cpus": args.node_cpus}
    if ref:
        per_student = sum(t["mean_s"] for t in ref["modules"].values())
        summary["per_student_s"] = round(per_student, 1)
        summary["class_minutes"] = {n: round(extrapolate(per_student, args.class_size, n, args.node_cpus), 1)
                                    for n in (1, 4, 16)}
        print(f"\nOne student's {len(ms)} modules: {per_student:.0f} s of grading, one job per CPU. A class of "
              f"{args.class_size} on nodes of {args.node_cpus} CPUs: "
              + ", ".join(f"{n} node(s) about {v:.0f} min" for n, v in summary["class_minutes"].items())
              + " (a submission per CPU at a time, each as long as here; the driver's merge and Ray's shipping "
                "not counted).")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
