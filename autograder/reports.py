"""What a grading run writes for the instructor: grades.csv, nbgrader's own export, the feedback folder,
timings.json."""
from __future__ import annotations

import csv
import json
import os
import shutil
from pathlib import Path

STATUSES = ("graded", "tests modified", "timed out", "kernel died", "invalid notebook", "missing")
FIELDS = ["student", "module", "score", "max_score", "status", "seconds", "detail", "flags"]


def write_reports(out: Path, main: Path, table: list[dict], wanted: list[str], workers: int, graded_now: int,
                  wall_s: float, jobs_wall_s: float = 0.0) -> None:
    """grades.csv, nbgrader's own export of the gradebook (nbgrader-grades.csv, for an LMS), the feedback
    folder (one page per row that was graded) and timings.json."""
    from nbgrader.api import Gradebook
    from nbgrader.plugins import CsvExportPlugin

    with open(out / "grades.csv", "w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows({k: r.get(k, "") for k in FIELDS} for r in table)
    with Gradebook(f"sqlite:///{main / 'gradebook.db'}") as gb:
        CsvExportPlugin(to=str(out / "nbgrader-grades.csv"), assignment=list(wanted)).export(gb)
    fb = out / "feedback"
    shutil.rmtree(fb, ignore_errors=True)
    for r in table:
        src = main / "feedback" / r["student"] / r["module"]
        if r["status"] != "missing" and src.exists():
            shutil.copytree(src, fb / r["student"] / r["module"])
    timings = {}
    for m in wanted:
        secs = sorted(r["seconds"] for r in table if r["module"] == m and r["status"] in ("graded", "tests modified"))
        if secs:
            peaks = [r.get("peak_rss_mib", 0) for r in table if r["module"] == m]
            fixed = [r["fixed_s"] for r in table if r["module"] == m and r.get("fixed_s") is not None]
            timings[m] = {"submissions": len(secs), "mean_s": round(sum(secs) / len(secs), 1),
                          "median_s": secs[len(secs) // 2], "max_s": secs[-1],
                          "max_tree_rss_mib": max(peaks),
                          "mean_fixed_s": round(sum(fixed) / len(fixed), 2) if fixed else None}
    (out / "timings.json").write_text(json.dumps(
        {"seconds_per_submission": timings, "jobs": workers, "graded_this_run": graded_now,
         "wall_s": round(wall_s, 1), "jobs_wall_s": round(jobs_wall_s, 1), "cpu_count": os.cpu_count()}, indent=1))
