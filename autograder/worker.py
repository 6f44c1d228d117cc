"""Autograde ONE submission in a scratch course root: ``python -m autograder.worker JOB STUDENT MODULE``.

Started by ``autograder.grade`` (through ``autograder.contain.run_limited``) with its working
directory ``JOB/root``, which holds ``nbgrader_config.py``, a gradebook with only this module,
the module's source and this one student's submission. nbgrader's autograde and
generate_feedback run in this one process (importing nbgrader costs seconds, so not twice);
the student's code runs in the kernel nbgrader starts (see ``autograder.contain`` for where
that kernel runs and what it can see). The result goes to ``JOB/result.json``; the parent
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


def main(argv: list[str]) -> int:
    _die_with_parent()
    job, student, module = Path(argv[0]), argv[1], argv[2]
    root = job / "root"
    from nbgrader.apps import NbGraderAPI
    from traitlets.config.loader import PyFileConfigLoader

    config = PyFileConfigLoader("nbgrader_config.py", path=str(root)).load_config()
    api = NbGraderAPI(config=config)
    start = time.perf_counter()
    result = {"student": student, "module": module}
    ag = api.autograde(module, student, force=True, create=True)
    result["autograde_seconds"] = round(time.perf_counter() - start, 2)
    result["success"] = bool(ag.get("success"))
    result["log"] = (ag.get("log") or "")[-8000:]
    result["error"] = (ag.get("error") or "")[-8000:]
    if result["success"]:
        fb = api.generate_feedback(module, student, force=True)
        result["feedback"] = bool(fb.get("success"))
        if not fb.get("success"):
            result["feedback_error"] = (fb.get("error") or fb.get("log") or "")[-4000:]
    (job / "result.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
