"""One submission graded in its own scratch root and process: the job's nbgrader root (the module's release and
gradebook, never the solutions), the jail's hidden folders, the limits (``autograder.contain``); the job's process
(``autograder.worker``) runs nbgrader's autograde, then the verdicts decided outside the kernel
(``autograder.checks``). Used by a local run (``autograder.grade``) and by a Ray cluster's node
(``autograder.cluster``) alike."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from autograder.checks import asked
from autograder.collect import Found
from autograder.contain import jail_available, run_limited, write_kernelspec
from autograder.paths import CONFIG, REPO, SOLUTIONS

# A grading job's nbgrader source folder. nbgrader's autograde copies every file of the assignment's source
# folder that is not a notebook over the submission (``Autograde.init_assignment``); a job's source folder holds
# the module's RELEASE (its scripts with their solution regions stubbed, its figures), never the solutions, so a
# submission's code reaches only what its student was given. The hidden tests come from the gradebook.
RELEASED = "released"
# A template's folder of the course's data (``autograder.grade.offline_digits``), copied into each job: its COURSE_DATA.
DATA = "data"


def config_text(root: Path, autograded: Path | None = None, timeout: float | None = None,
                 runtime: Path | None = None) -> str:
    lines = ["c = get_config()  # noqa: F821",
             f"load_subconfig({str(CONFIG)!r})  # noqa: F821  (the course's nbgrader settings)",
             f"c.CourseDirectory.root = {str(root)!r}",
             f"c.CourseDirectory.db_url = {'sqlite:///' + str(root / 'gradebook.db')!r}",
             "c.OverwriteCells.add_missing_cells = True"]
    if autograded:      # a grading job's root
        lines += [f"c.CourseDirectory.autograded_directory = {str(autograded)!r}",
                  f"c.CourseDirectory.source_directory = {RELEASED!r}"]
    if timeout:
        lines.append(f"c.Execute.timeout = {int(min(600, max(10, timeout)))}")
    if runtime and jail_available():
        # the jailed kernel has no network: talk to it over unix sockets, which live beside its connection
        # file in the one folder of the grading job that is bound into the jail
        lines += ["c.KernelManager.transport = 'ipc'",
                  f"c.KernelManager.connection_file = {str(runtime / 'kernel.json')!r}"]
    return "\n".join(lines) + "\n"


# The repository's folders a submission's kernel needs: the course's helper package, and the data it may read.
KERNEL_NEEDS = ("coursekit", "data")


def hidden_paths(out: Path, submissions: Path) -> list[Path]:
    """What a submission's kernel must not see: every folder of the repository but ``KERNEL_NEEDS`` and the one
    holding this Python (the solutions; the release, whose later modules' scripts hold earlier modules' answers;
    the tests; the history and builds), the grading output (other students' work, the gradebook) and the
    submissions."""
    python = [Path(p).resolve() for p in (sys.prefix, sys.base_prefix)]
    keep = [REPO / name for name in KERNEL_NEEDS]
    paths = [SOLUTIONS, REPO / ".git", REPO / "build", out]
    paths += [p for p in sorted(REPO.iterdir()) if p.is_dir() and p not in keep
              and not any(py.is_relative_to(p.resolve()) for py in python)]
    if submissions.is_dir():
        paths.append(submissions)
    else:
        paths.append(submissions.parent)
    return list(dict.fromkeys(p.resolve() for p in paths))


def job_threads(jobs_at_once: int) -> int:
    """Torch's threads for each job's kernel when ``jobs_at_once`` jobs share this machine: its CPUs (as
    ``coursekit.runtime.detect`` counts them: affinity and a container's quota) divided among them (on 2 cores and
    ``--jobs 2``, 1 each: two kernels of 2 threads each took 11-18% longer on module 07)."""
    from coursekit.runtime import detect

    return max(1, detect().num_cpus // max(1, jobs_at_once))


def run_job(f: Found, template: Path, jobs_base: Path, hide: list[Path], timeout: float,
            memory: int, feedback: bool = True, warm: bool = True, threads: int | None = None) -> dict:
    """Autograde one submission in its own scratch root and process (forked by a warm worker: see
    ``autograder.contain.WarmWorker``; ``warm=False``: a fresh ``python -m autograder.worker``, which the
    benchmark compares), with its HTML feedback page unless ``feedback`` is False; return what happened.
    ``threads``: the kernel's OMP_NUM_THREADS, unless the grader's environment sets it (an instructor's choice; a
    Ray task's, which Ray sets to its CPUs)."""
    job = Path(tempfile.mkdtemp(prefix="job-", dir=jobs_base))
    root = job / "root"
    root.mkdir()
    shutil.copytree(template / "course" / f.module, root / RELEASED / f.module,
                    ignore=shutil.ignore_patterns("*.ipynb", ".ipynb_checkpoints", "__pycache__"))
    shutil.copy(template / "gradebook.db", root / "gradebook.db")
    (root / "nbgrader_config.py").write_text(config_text(root, job / "work", timeout, job / "runtime"))
    shutil.copytree(f.folder, root / "submitted" / f.student / f.module)
    # The data: the kernel works on a copy of its own (module 03 writes files beside it); this process, whose
    # references may read it after the kernel ran, reads the template's, which the jail hides from the kernel
    if (template / DATA).is_dir():
        shutil.copytree(template / DATA, job / DATA)
    workdir = job / "work" / f.student / f.module
    env = {"COURSE_GRADING": "1", "COURSE_SIZE": "smoke", "COURSE_STORAGE": str(job / "storage"),
           "CUDA_VISIBLE_DEVICES": "", "COURSE_RECORD": "", "MPLBACKEND": "Agg",
           "JUPYTER_PATH": str(write_kernelspec(job, workdir, hide, REPO, [job / "runtime", job / "storage", job / DATA],
                                                env={"COURSE_DATA": str(job / DATA)})),
           "JUPYTER_RUNTIME_DIR": str(job / "runtime"), "PYTHONPATH": str(REPO),
           "COURSE_ASKED": json.dumps(asked(f.module)),      # the hidden inputs the test cells run for the grader
           "PYTHONDONTWRITEBYTECODE": "1"}
    if (template / DATA).is_dir():
        env["COURSE_DATA"] = str(template / DATA)
    if threads and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    argv = [str(job), f.student, f.module, *([] if feedback else ["--no-feedback"])]
    outcome = run_limited(None if warm else [sys.executable, "-m", "autograder.worker", *argv], cwd=root, env=env,
                          timeout=timeout, memory=memory, log=job / "worker.log", worker_argv=argv if warm else None)
    result = {}
    if (job / "result.json").exists():
        result = json.loads((job / "result.json").read_text())
    return {"job": job, "outcome": outcome, "result": result}
