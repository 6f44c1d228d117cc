"""Autograde ONE submission in a scratch course root: ``python -m autograder.worker JOB STUDENT MODULE
[--no-feedback]``, or, as ``python -m autograder.worker --serve``, a warm worker that forks such a job on each
request (``autograder.contain.WarmWorker``: the grader's way, so that each job does not import nbgrader again).

A job's working directory is ``JOB/root``, which holds ``nbgrader_config.py``, a gradebook with only this module,
the module's release and this one student's submission. nbgrader's autograde and generate_feedback run in the
job's process; the student's code runs in the kernel nbgrader starts (see ``autograder.contain`` for where
that kernel runs and what it can see). Between the two, ``autograder.checks.apply`` decides in this process, from
the data the test cells handed in, the score of every cell judged outside the kernel (in each of the module's
notebooks). The result goes to ``JOB/result.json``; the parent
merges the grades into the main gradebook.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _die_with_parent() -> None:
    """Linux: this process is killed when the one that started it dies (the grader, or the Ray worker of a
    cluster's node that is lost), so no grading outlives it: its kernel then goes too (bubblewrap's
    --die-with-parent). The job runs in a session of its own, which a parent's death does not reach."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)    # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# What a job imports before its kernel starts; a warm worker imports it once for every job it forks.
PRELOAD = ("autograder.checks", "nbgrader.apps", "nbgrader.converters.autograde", "nbgrader.converters.generate_feedback",
           "nbconvert.exporters.html", "traitlets.config.loader")


PREPARE_LIMIT_S = 180    # a module's references that take longer are left to each job (which then reports why)


def _prepare(module: str, env: dict) -> None:
    """The module's references computed once in this warm worker, with the first job's environment, for every job
    it forks (``autograder.checks.prepare``). Whatever goes wrong, each job computes them itself."""
    import os
    import signal

    def too_long(*_):
        raise TimeoutError(f"preparing {module}'s references took more than {PREPARE_LIMIT_S} s")

    saved = dict(os.environ)
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(PREPARE_LIMIT_S)
    sys.stdout.flush()
    answers = os.dup(1)            # this process answers the grader on stdout: nothing else may write there, so
    os.dup2(2, 1)                  # what the references print (and the ranks they fork) goes to stderr
    try:
        os.environ.update(env)
        from autograder.checks import prepare

        prepare(module)
    except Exception as e:  # noqa: BLE001  (the jobs compute them, and report a failure)
        print(f"warm worker: {module}'s references not prepared: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        sys.stdout.flush()
        os.dup2(answers, 1)
        os.close(answers)
        os.environ.clear()
        os.environ.update(saved)


def serve() -> int:
    """The warm worker (``autograder.contain.WarmWorker``): import ``PRELOAD``, say ``ready``, then for each
    request line (JSON: call, argv, cwd, env, log, cgroup_procs) fork a job that calls ``call`` (``module:function``,
    ``main`` of this module for a grading job) with argv, answer its pid, wait for it and answer its
    exit code. Ends when its stdin closes (the grader is gone)."""
    import importlib
    import os

    for name in PRELOAD:
        importlib.import_module(name)
    _die_with_parent()
    print("ready", flush=True)
    prepared: set[str] = set()
    for line in sys.stdin:
        req = json.loads(line)
        if req["call"] == "autograder.worker:main" and len(req["argv"]) >= 3 and req["argv"][2] not in prepared:
            prepared.add(req["argv"][2])
            _prepare(req["argv"][2], req["env"])
        pid = os.fork()
        if pid == 0:                                   # the job
            code = 70
            try:
                if req["cgroup_procs"]:                # into the job's memory cgroup before anything else
                    Path(req["cgroup_procs"]).write_text(str(os.getpid()))
                os.setsid()                            # its own session: the grader kills it as a group
                log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
                os.dup2(log, 1)
                os.dup2(log, 2)
                os.chdir(req["cwd"])
                os.environ.clear()
                os.environ.update(req["env"])
                module, _, function = req["call"].partition(":")
                code = getattr(importlib.import_module(module), function)(req["argv"])
            except BaseException:                      # noqa: BLE001  (whatever happens, the job's log says it)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code if isinstance(code, int) else 1)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


def main(argv: list[str]) -> int:
    _die_with_parent()
    t0 = time.perf_counter()
    job, student, module = Path(argv[0]), argv[1], argv[2]
    feedback = "--no-feedback" not in argv[3:]
    root = job / "root"
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    api = NbGraderAPI(config=config)
    start = time.perf_counter()
    result = {"student": student, "module": module, "setup_seconds": round(start - t0, 2)}
    ag = api.autograde(module, student, force=True, create=True)
    result["autograde_seconds"] = round(time.perf_counter() - start, 2)
    result["success"] = bool(ag.get("success"))
    result["log"] = (ag.get("log") or "")[-8000:]
    result["error"] = (ag.get("error") or "")[-8000:]
    from autograder.paths import notebooks

    graded = [job / "work" / student / module / f"{name}.ipynb" for name in notebooks(module)]
    if result["success"] and any(path.exists() for path in graded):
        # the cells whose score this process decides, from the data they handed in: never from what the kernel,
        # where the student's code ran, reported (autograder.checks), notebook by notebook; a notebook the student
        # did not hand in (nbgrader scored its cells 0) gets the verdict of a cell that handed in nothing
        from autograder.checks import apply

        result["outside"] = {}
        for path in graded:
            result["outside"].update(apply(path, f"sqlite:///{root / 'gradebook.db'}", module, student))
    if result["success"] and feedback:
        fb_start = time.perf_counter()
        fb = api.generate_feedback(module, student, force=True)
        result["feedback_seconds"] = round(time.perf_counter() - fb_start, 2)
        result["feedback"] = bool(fb.get("success"))
        if not fb.get("success"):
            result["feedback_error"] = (fb.get("error") or fb.get("log") or "")[-4000:]
    (job / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))
