"""Grading on a Ray cluster (``autograder.grade --address``) gives what local grading gives, and loses nothing
when a node is lost mid-run.

Module 01 (the fastest to grade): the reference solution, the untouched notebook, a student with a mistake
in every exercise (tests/mistakes) and two submissions that kill their own kernel (``os._exit``, a memory bomb
past the job's limit: "kernel died" once, as locally) and a snoop that looks for what the jail hides (on the
cluster the driver's output and submissions live outside the temp folder, as on shared storage every node
mounts: the task hides them too), graded locally and on a local Ray cluster of a head and 2 worker nodes of
1 CPU each (``coursekit.elastic.LocalCluster``: each node a raylet of its own). While three grading tasks
run, one on each node, the newest worker node is removed and another one joins: Ray runs the lost task again elsewhere, and the
gradebook holds each submission once, with the local run's scores, cell by cell."""
import shutil
import sqlite3
import threading
import time
import uuid
from pathlib import Path

import pytest

from autograder.bad_submissions import snoop_code
from autograder.contain import jail_available
from autograder.grade import grade
from autograder.samples import solution_answers, write_submission
from coursekit.elastic import LocalCluster
from test_grading import answers_file, cell_scores

MODULE = "01_ddp_pytorch"
MEMORY = 4 * 2**30
STUDENTS = ("ada", "blank", "partial", "exits", "membomb", "snoop")
DIED = ("exits", "membomb")
NODES = 3


def _submissions(folder, out):
    reference = solution_answers(MODULE)
    write_submission(folder, "ada", MODULE, reference)
    write_submission(folder, "blank", MODULE, {})
    write_submission(folder, "partial", MODULE, {**reference, **{
        gid: code if isinstance(code, str) else code[0] for gid, code in answers_file(MODULE).WRONG.items()}})
    first = next(iter(reference))          # the first answer cell: the kernel goes before any test runs
    write_submission(folder, "exits", MODULE, {**reference, first: "import os\nos._exit(1)"})
    write_submission(folder, "membomb", MODULE, {**reference, first: (
        "blocks = []\nwhile True:\n    blocks.append(b'x' * (32 << 20))  # 32 MiB a step, forever")})
    write_submission(folder, "snoop", MODULE, {**reference, first: reference[first] + "\n" + snoop_code(out, folder)})


def _busy_cpus() -> float:
    import ray

    return ray.cluster_resources().get("CPU", 0) - ray.available_resources().get("CPU", 0)


@pytest.fixture
def shared():
    """A folder outside the temp folder (which every jail replaces with its own), as shared storage is."""
    folder = Path.home() / ".cache" / f"course-grading-test-{uuid.uuid4().hex[:8]}"
    folder.mkdir(parents=True)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow
def test_a_ray_cluster_grades_as_locally_and_a_lost_node_loses_nothing(tmp_path, shared):
    tmp_path = shared
    subs = tmp_path / "submissions"
    _submissions(subs, tmp_path / "ray")
    local = {r["student"]: r for r in grade(subs, tmp_path / "local", only=[MODULE], quiet=True, jobs=2,
                                            timeout=600, memory=MEMORY)}
    on_ray, errors = {}, []
    with LocalCluster(worker_nodes=2, cpus_per_node=1) as cluster:
        def run():
            try:
                on_ray.update({r["student"]: r for r in grade(subs, tmp_path / "ray", only=[MODULE], quiet=True,
                                                              timeout=600, memory=MEMORY,
                                                              address=cluster.address)})
            except BaseException as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.time() + 300
        while _busy_cpus() < NODES and thread.is_alive() and time.time() < deadline:
            time.sleep(0.5)
        assert thread.is_alive() and _busy_cpus() >= NODES, "the grading tasks never ran at once"
        time.sleep(3)                      # both jobs are inside nbgrader now
        cluster.remove_node()              # a machine is lost with its task ...
        cluster.add_node()                 # ... and another one joins
        thread.join(900)
        assert not thread.is_alive(), "grading on the cluster did not finish"
    assert not errors, errors
    assert set(on_ray) == set(local) == set(STUDENTS)
    for student in STUDENTS:
        mine, theirs = on_ray[student], local[student]
        assert (mine["status"], mine["score"], mine["max_score"]) == (theirs["status"], theirs["score"],
                                                                      theirs["max_score"]), (mine, theirs)
        if student not in DIED:             # a dead kernel's submission has no cells in the gradebook
            assert cell_scores(tmp_path / "ray", student, MODULE) == cell_scores(tmp_path / "local", student, MODULE)
        assert (tmp_path / "ray" / "feedback" / student / MODULE / f"{MODULE}.html").exists()
    assert local["ada"]["score"] == local["ada"]["max_score"] > local["partial"]["score"] > 0
    assert all(on_ray[s]["status"] == "kernel died" and on_ray[s]["score"] == 0 for s in DIED), on_ray
    assert "memory" in on_ray["membomb"]["detail"], on_ray["membomb"]
    if jail_available():
        text = (tmp_path / "ray" / "feedback" / "snoop" / MODULE / f"{MODULE}.html").read_text()
        assert "SNOOP-SEES" in text, "the snoop cell did not run"
        seen = [line for line in text.splitlines() if "SNOOP-SEES" in line and "True" in line]
        assert not seen, f"a submission graded on a node could see: {seen}"
        assert "SNOOP-STUBS True" in text and "SNOOP-WROTE" not in text
    with sqlite3.connect(tmp_path / "ray" / "nbgrader" / "gradebook.db") as db:
        assert db.execute("select count(*) from submitted_assignment").fetchone()[0] == len(STUDENTS) - len(DIED), (
            "a submission was merged into the gradebook twice, or a dead kernel's")
