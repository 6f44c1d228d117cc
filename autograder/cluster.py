"""Grade on a Ray cluster: every (student, module) job is a Ray task that may run on any node.

    python -m autograder.grade SUBMISSIONS --address auto          # the Ray cluster this machine belongs to
    make grade SUBMISSIONS=... RAY_ADDRESS=10.0.0.1:6379            # any Ray cluster's address

What travels, and what does not:

* To the task: the submission folder and the module's one-module template (its gradebook, with the hidden
  tests, and its RELEASED files), each as a gzipped tar in Ray's object store. The solutions never leave the
  driver's machine.
* On the node, the task grades exactly as a local job does (``autograder.job.run_job``): its own scratch
  root, the node's bubblewrap jail (hiding the repository's folders, as locally, and the driver's output and
  submissions folders wherever the node has them: shared storage) and memory cgroup (where the node has them; each row says on which node it
  was graded and whether its kernel was jailed there), the wall-clock limit.
* Back to the driver: the job's gradebook, its autograded notebook and feedback page, and what happened
  (``Outcome``, nbgrader's result). The driver alone merges them into the main gradebook, once per job, as a
  local run does: the gradebook, ``grades.csv`` and the feedback are the same.

A node lost mid-run: Ray runs the task again elsewhere (``max_retries``), and since only the driver merges, and
only the result that reaches it, no submission is graded twice in the gradebook. A submission that kills its own
kernel is contained inside the task's job (its process tree, its cgroup): the task returns "kernel died" as
locally. Every node needs the grader's environment (this repository installed with ``pip install -e .``,
nbgrader, the course kernel, and bubblewrap for the jail); ``deploy/`` builds it.
"""
from __future__ import annotations

import dataclasses
import io
import socket
import tarfile
import tempfile
from pathlib import Path
from typing import Iterator

TASK_RETRIES = 3        # a task whose node died runs again, this many times at most


def pack(folder: Path, parts: list[str] | None = None) -> bytes:
    """``folder`` (or just ``parts`` of it, relative paths) as a gzipped tar."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for part in parts or ["."]:
            if (Path(folder) / part).exists():
                tar.add(Path(folder) / part, arcname=part)
    return buf.getvalue()


def unpack(data: bytes, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(dest, filter="data")
    return dest


def template_parts(module: str) -> list[str]:
    """What of a module's template a node needs: the gradebook, the release and the data, not the solutions."""
    from autograder.job import DATA

    return ["gradebook.db", f"course/{module}", DATA]


def grade_on_node(found, template_tar: bytes, submission_tar: bytes, timeout: float, memory: int,
                  feedback: bool = True, hide: tuple[str, ...] = ()) -> dict:
    """The body of a grading task: one job graded on this node; returns what the driver merges. ``hide``: the
    driver's own folders the kernel must not see (its output and the submissions), hidden wherever this node has
    them too, as on a cluster whose nodes all mount the same shared storage."""
    import shutil

    from autograder.contain import jail_available
    from autograder.job import hidden_paths, run_job

    base = Path(tempfile.mkdtemp(prefix="course-grading-"))
    try:
        template = unpack(template_tar, base / "template")
        submission = unpack(submission_tar, base / "submission")
        jobs = base / "jobs"
        jobs.mkdir()
        run = run_job(dataclasses.replace(found, folder=submission), template, jobs,
                      [*hidden_paths(base, base), *map(Path, hide)], timeout, memory, feedback)
        job = run["job"]
        where = f"{found.student}/{found.module}"
        return {"outcome": dataclasses.asdict(run["outcome"]), "result": run["result"],
                "files": pack(job, ["root/gradebook.db", f"root/feedback/{where}", f"work/{where}"]),
                "node": socket.gethostname(), "jailed": jail_available()}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run_jobs_on_ray(jobs: list, templates: dict[str, Path], address: str, memory: int,
                    cpus_per_job: float = 1.0, hide: list[Path] = ()) -> Iterator[tuple]:
    """Like ``autograder.grade.run_jobs``, on the Ray cluster at ``address``: yield (job, run) as each job's
    task returns, ``run`` holding a local folder with the job's files (removed after the yield)."""
    import shutil

    import ray

    from autograder.contain import Outcome

    if not ray.is_initialized():
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
    task = ray.remote(grade_on_node).options(num_cpus=cpus_per_job, memory=memory, max_retries=TASK_RETRIES)
    tpl = {m: ray.put(pack(templates[m], template_parts(m))) for m in sorted({j.found.module for j in jobs})}
    hidden = tuple(str(p) for p in hide)
    pending = {task.remote(j.found, tpl[j.found.module], pack(j.found.folder), j.timeout, memory, j.feedback,
                           hidden): j
               for j in jobs}
    local = Path(tempfile.mkdtemp(prefix="course-grading-merge-"))
    count = 0
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            job = pending.pop(done[0])
            try:
                payload = ray.get(done[0])
            except (ray.exceptions.RayError, OSError) as e:    # retries used up: the row says why
                payload = {"outcome": dataclasses.asdict(Outcome(None, 0.0, output=f"Ray task failed: {e}")),
                           "result": {"success": False, "error": f"the grading task failed on the cluster: "
                                                                  f"{type(e).__name__}: {str(e)[:300]}"},
                           "files": pack(local, []), "node": "", "jailed": False}
            count += 1
            folder = unpack(payload["files"], local / f"job-{count}")
            run = {"job": folder, "outcome": Outcome(**payload["outcome"]), "result": payload["result"],
                   "node": payload["node"], "jailed": payload["jailed"]}
            try:
                yield job, run
            finally:
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        shutil.rmtree(local, ignore_errors=True)
