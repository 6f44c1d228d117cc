"""The main gradebook (nbgrader's, under ``OUT/nbgrader``): each job's result merged into it by the parent alone,
an older version forgotten, a plain feedback page where nbgrader made none."""
from __future__ import annotations

import html
import shutil
from pathlib import Path

def _copy_fields(src, dest) -> None:
    """Every column of an nbgrader gradebook row but its keys: a field a newer nbgrader adds is copied too."""
    for column in type(src).__table__.columns:
        if not (column.primary_key or column.foreign_keys):
            setattr(dest, column.key, getattr(src, column.key))


def merge(main: Path, run: dict, student: str, module: str) -> float:
    """Copy one autograded submission (submission, notebooks, grades, comments) from the job's gradebook
    into the main gradebook; return its score."""
    from nbgrader.api import Gradebook

    job = run["job"]
    forget(main, student, module)                 # an older graded version, if any
    with Gradebook(f"sqlite:///{job / 'root' / 'gradebook.db'}") as wgb, \
            Gradebook(f"sqlite:///{main / 'gradebook.db'}") as gb:
        wsub = wgb.find_submission(module, student)
        _copy_fields(wsub, gb.add_submission(module, student))
        for wnb in wsub.notebooks:
            _copy_fields(wnb, gb.find_submission_notebook(wnb.name, module, student))
            for wg in wnb.grades:
                _copy_fields(wg, gb.find_grade(wg.name, wnb.name, module, student))
            for wc in wnb.comments:
                _copy_fields(wc, gb.find_comment(wc.name, wnb.name, module, student))
        gb.db.commit()
        score = gb.find_submission(module, student).score
    for sub, src in (("autograded", job / "work" / student / module),
                     ("feedback", job / "root" / "feedback" / student / module)):
        dest = main / sub / student / module
        shutil.rmtree(dest, ignore_errors=True)
        if src.exists():
            shutil.copytree(src, dest, ignore=shutil.ignore_patterns(".*", "__pycache__"))
    return score


def forget(main: Path, student: str, module: str) -> None:
    """Drop an older graded version of (student, module) from the main gradebook, its copies and feedback."""
    from nbgrader.api import Gradebook, MissingEntry

    with Gradebook(f"sqlite:///{main / 'gradebook.db'}") as gb:
        gb.update_or_create_student(student)
        try:
            gb.remove_submission(module, student)
        except MissingEntry:
            pass
    for sub in ("autograded", "feedback"):
        shutil.rmtree(main / sub / student / module, ignore_errors=True)


def plain_feedback(main: Path, row: dict) -> None:
    dest = main / "feedback" / row["student"] / row["module"] / f"{row['module']}.html"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(
        f"<!doctype html><meta charset='utf-8'><title>{html.escape(row['module'])}</title>"
        f"<h1>{html.escape(row['module'])}: {html.escape(row['student'])}</h1>"
        f"<p>Score: {row['score']} / {row['max_score']}</p><p>Status: {html.escape(row['status'])}</p>"
        f"<p>{html.escape(row['detail'])}</p>", encoding="utf-8")
