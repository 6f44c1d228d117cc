"""Grading speed: seconds per submission per module, and what a class would take.

    python -m autograder.benchmark [--students 4] [--jobs 2] [--class-size 30] [--out build/grading-bench]

Writes ``--students`` submissions of every module (alternately the reference solution and
the untouched notebook, the two ends of the work a grader does), grades them in one run
with ``--jobs`` at a time, and prints the seconds per submission per module (from
``OUT/timings.json``: wall seconds of each submission's own process, measured while
``--jobs`` ran at once) and the estimate for ``--class-size`` students x every module:
class-size x sum over modules of the mean seconds / jobs. Run it on an otherwise idle
machine (it is not a test: its numbers depend on the machine).
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--students", type=int, default=4)
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--class-size", type=int, default=30)
    p.add_argument("--modules", default=None, help="comma-separated (default: all)")
    p.add_argument("--out", type=Path, default=REPO / "build" / "grading-bench")
    args = p.parse_args(argv)
    ms = args.modules.split(",") if args.modules else modules()
    shutil.rmtree(args.out, ignore_errors=True)
    subs = args.out / "submissions"
    for i in range(args.students):
        for m in ms:
            write_submission(subs, f"student{i:02d}", m, solution_answers(m) if i % 2 == 0 else {})
    start = time.perf_counter()
    grade(subs, args.out / "grading", only=ms, jobs=args.jobs)
    wall = time.perf_counter() - start
    timings = json.loads((args.out / "grading" / "timings.json").read_text())["seconds_per_submission"]
    print(f"\n{'module':<22} {'s/submission':>12} {'max':>6} {'tree RSS MiB':>13}")
    for m in ms:
        t = timings[m]
        flag = "  > 30 s" if t["mean_s"] > 30 else ""
        print(f"{m:<22} {t['mean_s']:>12.1f} {t['max_s']:>6.1f} {t['max_tree_rss_mib']:>13}{flag}")
    per_student = sum(timings[m]["mean_s"] for m in ms)
    est = args.class_size * per_student / args.jobs
    print(f"\n{args.students * len(ms)} submissions in {wall:.0f} s wall with --jobs {args.jobs}; "
          f"one student's {len(ms)} modules: {per_student:.0f} s of grading.\n"
          f"A class of {args.class_size}: about {est / 60:.0f} min with --jobs {args.jobs} "
          f"({args.class_size} x {per_student:.0f} s / {args.jobs}).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
