"""nbgrader configuration of the course.

The instructor's source is ``solutions/`` (one folder per module: the notebook
with solutions and hidden tests, plus its scripts); the student release is
``course/``. Both paths are relative to the repository root, which is where
``make assignments`` and ``make grade`` run nbgrader from (the grader uses a
scratch course root under build/ of its own, see autograder/grade.py).
"""
from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets when nbgrader loads this file)

# the root this config file sits in (not coursekit.paths.REPO: a copy of the course's root is its own course)
REPO = Path(__file__).resolve().parent.parent

c.CourseDirectory.root = str(REPO)
c.CourseDirectory.source_directory = "solutions"
c.CourseDirectory.release_directory = "course"
c.CourseDirectory.db_url = f"sqlite:///{REPO / 'build' / 'release-gradebook.db'}"
# Only notebooks and the module's scripts travel to students.
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", ".*"]

# Training cells (a Ray Train fit on 2 CPU workers) take tens of seconds on a
# 2-core machine; nbgrader's default of 30 s per cell is too short for them.
c.Execute.timeout = 600
c.Execute.startup_timeout = 120
# Keep executing after a failing cell: one broken exercise costs its points, not the notebook.
c.Execute.allow_errors = True
# Students see their own stack traces in feedback; nothing else from the source leaks.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
# nbgrader scores a test cell that wrote anything to stderr as failed, a warning included (a library's
# deprecation notice, torch's c10d warning about a host name): only a failed check may cost points here.
# nbgrader's own IgnorePattern drops stderr output (any text) from the autograded notebook, and so from the
# feedback, before the grades are taken; errors are outputs of their own and still fail the cell.
c.IgnorePattern.enabled = True
c.IgnorePattern.pattern = r"[\s\S]"
