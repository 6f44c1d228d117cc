"""coursekit: the plumbing of the course (runtime, data, models, widgets, Ray set-up).

Teaching code (process groups, training loops, Ray Train calls) lives in the
notebooks and scripts; this package only holds what every module needs and
nobody should have to read twice."""
import os
import sys

from coursekit.runtime import Runtime, detect

__all__ = ["Runtime", "detect"]


def _validate_like_the_grader() -> None:
    """nbgrader's Validate button scores a test cell that wrote anything to stderr (a library's deprecation
    warning, torch's c10d notice) as failed; the grader drops stderr before scoring (``IgnorePattern`` in
    autograder/nbgrader_config.py), so only a failed check costs points. So that Validate says what the grader
    will say, a kernel that Validate runs (every notebook imports coursekit first) shows its stderr as ordinary
    output: the text still appears, the cell no longer counts as failed."""
    stream = sys.stderr
    if os.environ.get("NBGRADER_EXECUTION") == "validate" and type(stream).__name__ == "OutStream":
        stream.name = "stdout"     # ipykernel's OutStream publishes its text under this name


_validate_like_the_grader()
