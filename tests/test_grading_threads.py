"""The reference solution of every module keeps full marks on another thread count and another CPU code path.

tests/test_grading.py grades the reference with this machine's defaults (torch on every core). Here it is graded
again, every module, with torch on 1 thread and with MKL's conditional-numerical-reproducibility mode set to
COMPATIBLE (``MKL_CBWR``: the code path of CPUs without this one's instruction sets, which rounds differently; it is
how module 07's capstone once lost points on a Xeon whose results this machine did not reproduce). The kernels, the
ranks they start and the grader's own references all inherit the setting. A tolerance that holds only for this
machine's rounding fails here.
"""
import csv

import pytest

from autograder.grade import grade
from autograder.release import modules
from autograder.samples import solution_answers, write_submission


@pytest.mark.slow
def test_the_reference_gets_full_marks_at_one_thread_on_another_cpu_code_path(tmp_path, monkeypatch):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    for module in modules():
        write_submission(tmp_path / "submissions", "reference", module, solution_answers(module))
    grade(tmp_path / "submissions", tmp_path / "out", quiet=True, jobs=2, timeout=600, feedback=False)
    with open(tmp_path / "out" / "grades.csv", encoding="utf-8", newline="") as f:
        rows = {r["module"]: r for r in csv.DictReader(f)}
    lost = {m: (r["score"], r["max_score"], r["status"]) for m, r in rows.items()
            if r["status"] != "graded" or float(r["score"]) != float(r["max_score"])}
    assert set(rows) == set(modules())
    assert not lost, f"the reference lost points at 1 thread, MKL_CBWR=COMPATIBLE: {lost} (see {tmp_path / 'out'})"
