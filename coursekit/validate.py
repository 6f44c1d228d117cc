"""Validate notebooks from a terminal, as the Validate button does, with an exit status.

    python -m coursekit.validate course/02_ray_train/02_ray_train.ipynb [...]

Runs nbgrader's Validator with the settings the button loads (the course's cell time limit, from
``python -m coursekit.jupyter_setup``): the notebook runs in grading mode and its visible checks are
scored. Prints each failed check and exits 1 if any notebook failed (``nbgrader validate`` exits 0
whatever it finds), 0 when every visible check passed. A warning on stderr is not a failure, as when
grading. The hidden checks run only when the course is graded.
"""
from __future__ import annotations

import sys
from pathlib import Path


def validate(notebook: Path) -> list[str]:
    """The failed checks of ``notebook`` (each as the text Validate shows), [] when all pass."""
    from nbgrader.server_extensions.validate_assignment.handlers import ValidateAssignmentHandler
    from nbgrader.validator import Validator

    config = ValidateAssignmentHandler.load_config(None)     # what the button's handler loads
    result = Validator(config=config).validate(str(notebook))
    problems = [f"a read-only cell was changed:\n{c['source'][:300]}" for c in result.get("changed", [])]
    problems += [f"a cell's type was changed:\n{c['source'][:300]}" for c in result.get("type_changed", [])]
    problems += [f"{c['source'].splitlines()[0][:100] if c['source'] else ''}\n{c['raw_error'][-1500:]}"
                 for c in result.get("failed", [])]
    return problems


def main(argv: list[str] | None = None) -> int:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        if not path.is_file():
            print(f"{path}: no such notebook", file=sys.stderr)
            status = 2
            continue
        problems = validate(path)
        print(f"{path}: " + ("Success! Every visible check passed." if not problems else
                             f"{len(problems)} check(s) failed"))
        for p in problems:
            print("  - " + p.replace("\n", "\n    "))
        status = status or (1 if problems else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
