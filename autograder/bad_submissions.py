"""A corpus of bad submissions, built from a real module's release (course/), to test the grader.

    python -m autograder.bad_submissions FOLDER [--module 01_ddp_pytorch] [--out build/grading]

writes one student per kind of trouble in nbgrader's layout (``FOLDER/<student>/<module>/``)
and ``FOLDER/expected.json``: student -> the status (and score: "full", "zero", or "partial": more than 0
and less than the maximum) the grader must give. Every notebook is the released notebook with code written into it
(``autograder.samples.fill``), so cell ids, checksums and locks are the real ones. Each kind of
trouble is in the module's first notebook (``autograder.paths.notebooks``; "renamed" renames it);
a module's other notebooks, if it has several, hold the reference solution.

``good`` (the reference solution) is in the corpus so a test can check that a good student's
grade survives the bad ones in the same run. The "snoop" student probes the paths given
(``out``: the grading output folder; the submissions folder itself) and, when given a ``port``, a
server on this machine's loopback, and prints what it could see, reach and write, with markers a
test can look for in its feedback.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import nbformat

from autograder.paths import REPO, SOLUTIONS, notebooks
from autograder.samples import fill, fill_all, solution_answers

MODULE = "01_ddp_pytorch"     # the fastest module to grade (see README's instructor section)


def _first_solution(nb) -> str:
    return next(c.metadata["nbgrader"]["grade_id"] for c in nb.cells
                if c.metadata.get("nbgrader", {}).get("solution") and c.cell_type == "code")


def _test_cells(nb) -> list:
    return [c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade")
            and c.metadata["nbgrader"].get("locked")]


def snoop_code(out: Path, submissions: Path, port: int | None = None) -> str:
    """Code that tries to read what it must not see, to write where it must not write and (given a
    ``port``) to reach a server on this machine's loopback."""
    probes = {"solutions": SOLUTIONS / MODULE / f"{notebooks(MODULE)[0]}.ipynb",
              "gradebook": Path(out) / "nbgrader" / "gradebook.db",
              "submissions": Path(submissions) / "good",
              "scratch_source": "../../../root/released",
              "scratch_gradebook": "../../../root/gradebook.db",
              # the release's later modules (module 07's scripts hold the answers of 01, 05 and 06) and the tests
              "release": REPO / "course" / "07_scaling_up",
              "tests": REPO / "tests" / "test_grading.py"}
    targets = [SOLUTIONS / "PWNED.txt", Path(out) / "PWNED.txt", REPO / "PWNED.txt",
               Path(submissions) / "good" / "PWNED.txt"]
    return "\n".join([
        "import os",
        f"for name, path in {json.dumps({k: str(v) for k, v in probes.items()})}.items():",
        "    print('SNOOP-' + 'SEES', name, os.path.exists(path))",
        # module 01's script beside the notebook: the release's, its answers stubbed
        "print('SNOOP-' + 'STUBS', 'raise NotImplementedError' in open('ddp_exercises.py').read())",
        f"for path in {json.dumps([str(t) for t in targets])}:",
        "    try:",
        "        with open(path, 'w') as f:",
        "            f.write('written by a submission')",
        "        print('SNOOP-' + 'WROTE', path)",
        "    except OSError as e:",
        "        print('SNOOP-' + 'BLOCKED', path, type(e).__name__)",
        *([] if port is None else [
            "import socket",
            "s = socket.socket()",
            "s.settimeout(3)",
            f"print('SNOOP-' + 'SEES', 'network', s.connect_ex(('127.0.0.1', {int(port)})) == 0)"]),
    ])


def build(folder: Path, module: str = MODULE, out: Path | None = None, port: int | None = None) -> dict[str, dict]:
    """Write the corpus into ``folder``; return student -> {"status", "score"} expected. ``port``: a
    server the snoop tries to reach."""
    folder = Path(folder)
    out = Path(out) if out else REPO / "build" / "grading"
    reference = solution_answers(module)
    first = _first_solution(fill(module, {}))
    main_nb = notebooks(module)[0]
    rest = {n: nb for n, nb in fill_all(module, reference).items() if n != main_nb}   # the module's other notebooks
    expected: dict[str, dict] = {}

    def write(student: str, nb=None, name: str | None = None, raw: str | None = None,
              status: str = "graded", score: str = "full") -> None:
        dest = folder / student / module
        shutil.copytree(REPO / "course" / module, dest, dirs_exist_ok=True)
        for other, filled in rest.items():
            nbformat.write(filled, dest / f"{other}.ipynb")
        target = dest / (name or f"{main_nb}.ipynb")
        if name:
            (dest / f"{main_nb}.ipynb").unlink()
        if raw is not None:
            target.write_text(raw, encoding="utf-8")
        else:
            nbformat.write(nb, target)
        expected[student] = {"status": status, "score": score}

    def with_cell(code: str, at: int = 0):
        nb = fill(module, reference)
        nb.cells.insert(at, nbformat.v4.new_code_cell(code))
        return nb

    write("good", fill(module, reference))
    write("busy_loop", fill(module, {**reference, first: "while True:\n    pass"}), status="timed out", score="zero")
    write("exits", fill(module, {**reference, first: "import os\nos._exit(1)"}), status="kernel died", score="zero")
    write("membomb", fill(module, {**reference, first: (
        "blocks = []\nwhile True:\n    blocks.append(b'x' * (32 << 20))  # 32 MiB a step, forever")}),
        status="kernel died", score="zero")
    nb = fill(module, reference)
    nb.cells.remove(_test_cells(nb)[0])
    write("deleted_test", nb, status="tests modified")
    nb = fill(module, reference)
    _test_cells(nb)[0].source = "# the tests are wrong, I skip them\npass"
    write("edited_test", nb, status="tests modified")
    # a module of several notebooks: the broken one is set aside, the others (the reference here) earn their points
    broken = {"status": "graded", "score": "partial"} if rest else {"status": "invalid notebook", "score": "zero"}
    write("bad_json", raw='{"cells": [{"cell_type": "code", "source": "print(1)"', **broken)
    write("empty", raw="", **broken)
    write("renamed", fill(module, reference), name=f"{main_nb}-Copy1.ipynb")
    write("snoop", with_cell(snoop_code(out, folder, port)))
    write("chatty", with_cell("for i in range(100_000):\n    print('a line of output that nobody reads', i)"))
    # right answers whose code warns on stderr in every later cell, the tests' included: full marks all the same
    write("warns", with_cell("import sys, warnings\n"
                             "def _warn(*_):\n"
                             "    warnings.warn('this API is deprecated', DeprecationWarning, stacklevel=1)\n"
                             "    print('[W socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved',"
                             " file=sys.stderr)\n"
                             "warnings.simplefilter('always')\n"
                             "get_ipython().events.register('post_run_cell', _warn)"))
    write("zoë_müller-ñ", fill(module, reference))
    (folder / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False), encoding="utf-8")
    return expected


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--module", default=MODULE)
    p.add_argument("--out", type=Path, default=None, help="the grading output folder the snoop probes")
    args = p.parse_args(argv)
    for student, exp in build(args.folder, args.module, args.out).items():
        print(f"{student:<16} {exp['status']} ({exp['score']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
