"""The reference solution of every module keeps full marks on another thread count and another CPU code path.

tests/test_grading.py grades the reference as the grader shares this machine's cores among its jobs
(``autograder.job.job_threads``: on 2 cores and --jobs 2, torch on 1 thread in each kernel). Here it is graded
again, every module, with torch on 2 threads in every kernel (the grader keeps an OMP_NUM_THREADS its environment
sets) and with MKL's conditional-numerical-reproducibility mode set to COMPATIBLE (``MKL_CBWR``: the code path of
CPUs without this one's instruction sets, which rounds differently; it is how module 07's capstone once lost points
on a Xeon whose results this machine did not reproduce). The kernels and the ranks they start inherit the setting.
A tolerance that holds only for this machine's rounding fails here.
"""
import csv

import pytest

from autograder.grade import grade
from autograder.release import modules
from autograder.samples import solution_answers, write_submission


@pytest.mark.slow
def test_the_reference_gets_full_marks_on_two_threads_and_another_cpu_code_path(tmp_path, monkeypatch):
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.setenv(name, "2")
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    for module in modules():
        write_submission(tmp_path / "submissions", "reference", module, solution_answers(module))
    grade(tmp_path / "submissions", tmp_path / "out", quiet=True, jobs=2, timeout=600, feedback=False)
    with open(tmp_path / "out" / "grades.csv", encoding="utf-8", newline="") as f:
        rows = {r["module"]: r for r in csv.DictReader(f)}
    lost = {m: (r["score"], r["max_score"], r["status"]) for m, r in rows.items()
            if r["status"] != "graded" or float(r["score"]) != float(r["max_score"])}
    assert set(rows) == set(modules())
    assert not lost, f"the reference lost points at 2 threads, MKL_CBWR=COMPATIBLE: {lost} (see {tmp_path / 'out'})"
