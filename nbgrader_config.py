"""nbgrader's own commands from the repository root (instructors).

nbgrader reads ``nbgrader_config.py`` from the folder it runs in. This one loads the course's settings
from ``autograder/nbgrader_config.py`` (the one file that holds them: course root = this folder, source
``solutions/``, release ``course/``, gradebook ``build/release-gradebook.db``), so that from here

    nbgrader generate_assignment 02_ray_train --force      # what `make assignments` does for one module
    nbgrader db student import roster.csv
    jupyter lab        # then /formgrader

work on this course. ``make assignments`` and ``make grade`` do not read this file (they run nbgrader in
course roots of their own). Instructor-only: the student release does not contain it (the Validate
button's settings come from ``python -m coursekit.jupyter_setup``).
"""
import sys
from pathlib import Path

c = get_config()  # noqa: F821  (provided by traitlets when nbgrader loads this file)

REPO = Path(__file__).resolve().parent
load_subconfig(str(REPO / "autograder" / "nbgrader_config.py"))  # noqa: F821
(REPO / "build").mkdir(exist_ok=True)      # the gradebook's folder (a fresh clone has no build/)
RELEASE = c.CourseDirectory.release_directory     # "course"


def _stub_scripts(assignment, **_):
    """After ``nbgrader generate_assignment``: stub the solution regions of the module's scripts, as
    ``make assignments`` does (nbgrader copies files other than notebooks unchanged)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from autograder.release import strip_scripts

    for folder in (REPO / RELEASE).glob(assignment):
        strip_scripts(folder)


c.GenerateAssignment.post_convert_hook = _stub_scripts
