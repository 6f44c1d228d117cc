"""Autograde a folder of submissions: grades.csv plus HTML feedback per student.

    python -m autograder.grade SUBMISSIONS [--out build/grading]      # make grade SUBMISSIONS=...

SUBMISSIONS uses nbgrader's layout: ``SUBMISSIONS/<student_id>/<module>/<module>.ipynb``
(a student's whole module folder, as they downloaded it from course/).

The grader works in a scratch nbgrader course under ``OUT/nbgrader`` with its own
gradebook: the instructor's notebooks from ``solutions/`` (hidden tests
included) are registered there, every submission is autograded (its read-only
cells restored from the source, the module's scripts taken from the source),
and the results are exported. Nothing under solutions/ or course/ is written.
Notebooks run with ``COURSE_GRADING=1``: small sizes, no downloads.

Output: ``OUT/grades.csv`` (student, module, score, max_score, status) and
``OUT/feedback/<student>/<module>/<module>.html``.
"""
from __future__ import annotations

import argparse
import csv
import shutil
import subprocess
import sys
import time
from pathlib import Path

from autograder.release import CONFIG, SOLUTIONS, modules, tool_env

NBGRADER = str(Path(sys.executable).parent / "nbgrader")


def _run(args: list[str], root: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([NBGRADER, *args, f"--CourseDirectory.root={root}",
                           f"--CourseDirectory.db_url=sqlite:///{root / 'gradebook.db'}"],
                          cwd=root, capture_output=True, text=True, env=tool_env(env))


def find_submissions(folder: Path) -> dict[str, list[str]]:
    """student -> modules submitted (nbgrader layout)."""
    known = set(modules())
    found: dict[str, list[str]] = {}
    for student in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
        mods = sorted(m.name for m in student.iterdir() if m.is_dir() and m.name in known
                      and (m / f"{m.name}.ipynb").exists())
        found[student.name] = mods
    return found


def grade(submissions: Path, out: Path, only: list[str] | None = None, quiet: bool = False) -> list[dict]:
    """Grade everything under ``submissions``; return one row per (student, module)."""
    submissions, out = Path(submissions).resolve(), Path(out).resolve()
    if not submissions.is_dir():
        raise SystemExit(f"error: no submissions folder at {submissions} "
                         "(expected SUBMISSIONS/<student>/<module>/<module>.ipynb)")
    found = find_submissions(submissions)
    wanted = only or sorted({m for mods in found.values() for m in mods})
    root = out / "nbgrader"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    shutil.copy(CONFIG, root / "nbgrader_config.py")
    shutil.copytree(SOLUTIONS, root / "solutions",
                    ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    say = (lambda *a: None) if quiet else (lambda *a: print(*a, flush=True))

    for m in wanted:
        r = _run(["generate_assignment", m, "--force"], root)
        if r.returncode:
            raise RuntimeError(f"could not register {m} in the gradebook:\n{r.stderr[-2000:]}")
    for student, mods in found.items():
        _run(["db", "student", "add", student], root)
        for m in mods:
            if m in wanted:
                shutil.copytree(submissions / student / m, root / "submitted" / student / m)

    env = {"COURSE_GRADING": "1", "COURSE_SIZE": "smoke",
           "COURSE_STORAGE": str(root / "ray_results"), "CUDA_VISIBLE_DEVICES": "", "COURSE_RECORD": ""}
    logs = {}
    for m in wanted:
        n = sum(m in mods for mods in found.values())
        say(f"autograding {m}: {n} submission(s) ...")
        start = time.perf_counter()
        r = _run(["autograde", m, "--force"], root, env=env)
        logs[m] = r.stdout + r.stderr
        say(f"  done in {time.perf_counter() - start:.0f} s")
        _run(["generate_feedback", m, "--force"], root)

    rows = export(root, found, wanted, logs)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "grades.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["student", "module", "score", "max_score", "status"])
        writer.writeheader()
        writer.writerows(rows)
    if (root / "feedback").exists():
        shutil.rmtree(out / "feedback", ignore_errors=True)
        shutil.copytree(root / "feedback", out / "feedback")
    for m, log in logs.items():
        (out / f"autograde-{m}.log").write_text(log)
    return rows


def export(root: Path, found: dict[str, list[str]], wanted: list[str], logs: dict[str, str]) -> list[dict]:
    """One row per (student, module): the score from the gradebook, or why there is none."""
    from nbgrader.api import Gradebook, MissingEntry

    rows = []
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for student in sorted(found):
            for m in wanted:
                max_score = gb.find_assignment(m).max_score
                row = {"student": student, "module": m, "score": 0.0, "max_score": max_score}
                if m not in found[student]:
                    row["status"] = "missing"
                else:
                    try:
                        sub = gb.find_submission(m, student)
                        row["score"] = round(sub.score, 2)
                        row["status"] = "graded"
                    except MissingEntry:
                        row["status"] = "error: could not be autograded (see autograde log)"
                rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("submissions", type=Path)
    p.add_argument("--out", type=Path, default=Path("build/grading"))
    p.add_argument("--modules", default=None, help="comma-separated modules to grade (default: all found)")
    args = p.parse_args(argv)
    rows = grade(args.submissions, args.out, args.modules.split(",") if args.modules else None)
    for r in rows:
        print(f"{r['student']:<20} {r['module']:<18} {r['score']:>6} / {r['max_score']:<6} {r['status']}")
    print(f"grades: {args.out / 'grades.csv'}; feedback: {args.out / 'feedback'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
