"""Submissions that reach for the grading machinery, listed for a human look (they decide nothing).

``scan`` reads the code a student wrote (answer cells and cells they added; never the release's own cells) and
returns each line that touches what a grade could be forged through: IPython's hooks and transformers, the
kernel's messaging, ``builtins``, tracing and the call stack, the grading environment, code objects, and
attributes of the libraries the checks call (torch, numpy, Ray, coursekit) set from outside. A right answer
rarely needs any of them; an instructor reads the line and decides.
"""
from __future__ import annotations

import re
from pathlib import Path

PATTERNS = {
    "IPython hooks": r"get_ipython|input_transformers|ast_transformers|\.events\.(register|unregister)|"
                     r"post_run_cell|pre_run_cell|run_cell\b|InteractiveShell|set_custom_exc|showtraceback",
    "kernel messaging": r"ipykernel|jupyter_client|\bSession\b|\.send\s*=|iopub|shell_channel|comm_manager",
    "builtins": r"\bbuiltins\b|__builtins__|__import__",
    "tracing and the call stack": r"sys\.settrace|sys\.setprofile|settrace|_getframe|\binspect\.(stack|currentframe|"
                                  r"getouterframes)|f_back|f_globals|f_locals|traceback\.(extract|walk)_stack|"
                                  r"sys\.excepthook|sys\.modules\[",
    "the grading environment": r"COURSE_GRADING|NBGRADER|nbgrader|HIDDEN TESTS|gradebook|autograde",
    "code objects": r"__code__|__globals__|__closure__|types\.(FunctionType|CodeType)|(?<![\w.])(exec|eval|compile)\s*\(|"
                    r"gc\.get_(referrers|objects)",
    "patched libraries": r"\b(setattr|delattr)\s*\(\s*(torch|np|numpy|ray|coursekit|math|os|sys|pd|pandas)\b|"
                         r"^\s*(torch|np|numpy|ray|coursekit|math|pd|pandas|os|sys|check_\w+|record_answer|hand_in)"
                         r"(\.\w+)*\s*=[^=]|\bmonkeypatch\b|unittest\.mock|\bmock\.patch",
}
_COMPILED = {kind: re.compile(pattern, re.MULTILINE) for kind, pattern in PATTERNS.items()}


def student_cells(nb) -> list[tuple[str, str]]:
    """(name, source) of every code cell the student wrote: answer cells (by grade_id) and added cells."""
    out = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution"):
            out.append((meta.get("grade_id", f"cell {index + 1}"), cell.source))
        elif not meta.get("grade_id"):                     # not from the release: a cell the student added
            out.append((f"added cell {index + 1}", cell.source))
    return out


def scan(notebook: Path | str, limit: int = 5) -> list[str]:
    """Up to ``limit`` lines "<cell>:<line>: <kind>: <code>" of ``notebook``'s student code that need a look."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception:  # noqa: BLE001  (the grader's pre-check reports an unreadable notebook)
        return []
    found = []
    for name, source in student_cells(nb):
        for number, line in enumerate(source.splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            kinds = [kind for kind, pattern in _COMPILED.items() if pattern.search(line)]
            if kinds:
                found.append(f"{name}:{number}: {', '.join(kinds)}: {line.strip()[:120]}")
    return found[:limit] + ([f"... and {len(found) - limit} more lines"] if len(found) > limit else [])
