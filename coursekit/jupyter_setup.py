"""Register the course's Jupyter kernel and the settings of nbgrader's Validate button.

    python -m coursekit.jupyter_setup --sys-prefix   # into this environment (make, Binder)
    python -m coursekit.jupyter_setup --user         # for this user (Anyscale workspace, conda)

Installs the kernel the notebooks ask for, ``ray-train-course`` ("Python (Ray Train course)"),
and an ``nbgrader_config.py`` in the same Jupyter folder that gives the **Validate** button of
JupyterLab the grader's per-cell time limit (nbgrader's default, 30 s, is shorter than the
course's slowest checks). Validate, like the grader, runs a notebook in grading mode
(``coursekit.runtime.detect`` reads nbgrader's ``NBGRADER_EXECUTION``): the demo training runs
are skipped and the exercise checks run at the small size. It runs the visible tests only; the
hidden ones run when the course is graded.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

KERNEL = "ray-train-course"
CELL_TIMEOUT_S = 600
MARK = "coursekit.jupyter_setup"

VALIDATE_CONFIG = f'''\
# Written by `python -m {MARK}`: nbgrader's Validate button gets the course grader's cell time limit.
c = get_config()  # noqa: F821
c.Execute.timeout = {CELL_TIMEOUT_S}
c.Execute.startup_timeout = 120
'''


def install(user: bool = False) -> list[Path]:
    """Install the kernel and the Validate settings; return the paths written."""
    from ipykernel import kernelspec
    from jupyter_core.paths import jupyter_config_dir

    prefix = None if user else sys.prefix
    kernel = Path(kernelspec.install(user=user, prefix=prefix, kernel_name=KERNEL,
                                     display_name="Python (Ray Train course)"))
    config_dir = Path(jupyter_config_dir()) if user else Path(sys.prefix) / "etc" / "jupyter"
    config_dir.mkdir(parents=True, exist_ok=True)
    config = config_dir / "nbgrader_config.py"
    if config.exists() and MARK not in config.read_text():
        raise SystemExit(f"{config} exists and is not the course's: add these lines to it yourself:\n"
                         f"{VALIDATE_CONFIG}")
    config.write_text(VALIDATE_CONFIG)
    return [kernel, config]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="install for this user (~/.local, ~/.jupyter)")
    where.add_argument("--sys-prefix", action="store_true", help="install into this environment (default)")
    args = p.parse_args(argv)
    for path in install(user=args.user):
        print(f"installed {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
