"""Verdicts decided outside the student's kernel.

A submission's notebook runs in a jailed kernel (``autograder.contain``); whatever that kernel reports about
itself (an error, its absence, a reply's status) could have been forged by the code that ran in it. For the
cells listed here the grade is decided instead in the grading job's own process, which never runs notebook code:
the test cell hands in plain JSON data (``coursekit.evidence.hand_in``, an output of its own MIME type), and
``apply`` reads that data from the autograded notebook, runs the checks (the visible ones, which the notebook
also runs, and the hidden ones, which only exist here), writes each cell's score into the job's gradebook and
its verdict into the notebook that the feedback page is made from.

What a student's code can still change is the data it hands in: to pass, that data has to be right.

Judged here: every graded cell of every module. The concept questions (``concepts``) and the code exercises of
modules 01 (``ddp01``), 02 (``ray02``), 03 (``data03``), 04 (``ft04``), 05 (``fsdp05``), 06 (``ds06``) and 07
(``scale07``): their test cells hand in the runs and run the hidden cases the grader asks for (``asked``: inputs,
never code); the references are computed here (once per warm worker: ``prepare``). ``tamper.scan`` lists
submissions that reach for the grading machinery, for a human look.
"""
from __future__ import annotations

from pathlib import Path

import importlib

from autograder.checks import concepts
from coursekit.evidence import MIME

VERDICT = "Graded outside your kernel"


# module -> its code exercises' checks here: CHECKS (grade_id -> check of the handed-in data, which raises
# AssertionError or returns what passed), ASKED (grade_id -> the hidden inputs its test cell runs when grading),
# HIDDEN_CHECKS (the cells whose checks here demand more than the notebook's visible ones, where ASKED does not
# show it) and PREPARE (the references every submission shares)
# (one file here per module: ddp01, ray02, data03, ft04, fsdp05, ds06, scale07; a module without its file yet is
# judged in the kernel)
FILES = {"01_ddp_pytorch": "ddp01", "02_ray_train": "ray02", "03_ray_data": "data03", "04_fault_tolerance": "ft04",
         "05_fsdp2": "fsdp05", "06_deepspeed": "ds06", "07_scaling_up": "scale07"}
CODE = {module: importlib.import_module(f"autograder.checks.{name}") for module, name in FILES.items()
        if (Path(__file__).parent / f"{name}.py").exists()}


def prepare(module: str) -> None:
    """Compute now what ``module``'s checks compute the same way for every submission (their references: each checks
    module's ``PREPARE``). A warm worker calls it before it forks a job (``autograder.worker.serve``), so that its
    jobs share the result instead of each computing it again; only the grader's own code runs here.

    On one torch thread: a process that forks must not have started OpenMP's thread pool (a forked job would wait
    forever for the pool's threads, which it does not have); the tolerances hold at 1 thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for make in getattr(CODE.get(module), "PREPARE", ()):
            make()
    finally:
        torch.set_num_threads(threads)


def judged_outside(module: str) -> set[str]:
    """The grade_ids of ``module`` whose score is decided here."""
    return set(concepts.KEYS.get(module, {})) | set(getattr(CODE.get(module), "CHECKS", {}))


def asked(module: str) -> dict[str, list]:
    """What the grader asks ``module``'s test cells to run besides their own inputs (``COURSE_ASKED``)."""
    return dict(getattr(CODE.get(module), "ASKED", {}))


def judge(module: str, grade_id: str, data: dict | None) -> tuple[bool, str]:
    """(passed, message) of one cell from its handed-in data (None: nothing was handed in)."""
    if grade_id in concepts.KEYS.get(module, {}):
        return concepts.judge(module, grade_id, data)
    check = getattr(CODE.get(module), "CHECKS", {}).get(grade_id)
    if check is None:
        raise KeyError(f"{module}: {grade_id} is not judged outside the kernel")
    if data is None:
        return False, ("the test cell handed in nothing: it did not run to its end (see its error above), or "
                       "something stopped it")
    try:
        return True, f"passed: {check(data)}"
    except AssertionError as e:
        return False, str(e)
    except Exception as e:  # noqa: BLE001  (data of the wrong shape: a failed check, never a crashed grader)
        return False, f"the data this test cell handed in could not be checked ({type(e).__name__}: {e})"


def evidence(cell) -> dict | None:
    """The data a test cell handed in: the last evidence output of that cell that names the cell's own grade_id
    (an answer cell's outputs, or another cell's, count for nothing). Plain JSON, or None."""
    grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
    found = None
    for output in cell.get("outputs", []):
        payload = output.get("data", {}).get(MIME) if output.get("output_type") in ("display_data", "execute_result") \
            else None
        if isinstance(payload, dict) and payload.get("grade_id") == grade_id and isinstance(payload.get("data"), dict):
            found = payload["data"]
    return found


def _verdict_output(passed: bool, message: str):
    import nbformat

    if passed:
        return nbformat.v4.new_output("stream", name="stdout", text=f"{VERDICT}: {message}\n")
    return nbformat.v4.new_output("error", ename=VERDICT, evalue=message, traceback=[f"{VERDICT}: {message}"])


def apply(notebook: Path, gradebook_url: str, module: str, student: str) -> dict[str, bool]:
    """Judge every cell of ``judged_outside(module)`` that belongs to the autograded ``notebook`` (one of the module's
    notebooks, ``autograder.paths.notebook_of``): its score into the gradebook, under that notebook's name (full
    points or 0, whatever the kernel reported), its verdict appended to the cell's outputs (the evidence outputs
    removed). A ``notebook`` that does not exist (the student did not hand it in): each of its cells judged as
    handing in nothing, and no file written. Returns grade_id -> passed."""
    import nbformat
    from nbgrader.api import Gradebook, MissingEntry

    from autograder.paths import notebook_of, notebooks

    notebook = Path(notebook)
    name = notebook.stem
    first = notebooks(module)[0]     # a grade_id in none of the module's notebooks counts as the first one's
    outside = {gid for gid in judged_outside(module) if notebook_of(module, gid, default=first) == name}
    nb = nbformat.read(notebook, as_version=4) if notebook.exists() else None
    verdicts: dict[str, tuple[bool, str]] = {}
    for cell in nb.cells if nb is not None else []:
        gid = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.cell_type != "code" or gid not in outside or gid in verdicts:
            continue
        passed, message = judge(module, gid, evidence(cell))
        verdicts[gid] = (passed, message)
        cell.outputs = [o for o in cell.get("outputs", []) if MIME not in o.get("data", {})]
        cell.outputs.append(_verdict_output(passed, message))
    for gid in outside - set(verdicts):       # not in the notebook at all: nothing handed in
        verdicts[gid] = judge(module, gid, None)
    if nb is not None:
        nbformat.write(nb, notebook)
    with Gradebook(gradebook_url) as gb:
        for gid, (passed, _) in verdicts.items():
            try:
                grade = gb.find_grade(gid, name, module, student)
            except MissingEntry:
                continue
            grade.auto_score = grade.max_score if passed else 0.0
        gb.db.commit()
    return {gid: passed for gid, (passed, _) in verdicts.items()}
