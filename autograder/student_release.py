"""The student-only copy of the course, and the check that no answer or hidden test is in it.

    python -m autograder.student_release [--into build/student-release]     # make release

writes ``course/`` (the nbgrader release: notebooks without solutions or hidden tests, and the
modules' scripts), ``coursekit/``, ``binder/``, ``deploy/`` (the cluster launcher config, the course
image's Dockerfile and the KubeRay manifests that module 07 tells students to use; the image builds
from the release root), ``requirements.txt``, ``environment.yml``, ``pyproject.toml`` and a student
README (``autograder/STUDENT_README.md``) into the folder. Not the Makefile: its targets beyond
``venv``/``lab`` need tests/ and autograder/, and nothing given to students names a make target
(tests/test_release.py checks every path and ``make`` target the notebooks and that README name).
Not ``nbgrader_config.py`` either (the instructor's course settings): the Validate button's settings
come from ``python -m coursekit.jupyter_setup``. It then checks every file in the folder with
``leaks()``: no nbgrader solution/hidden-test marker, and no
line of any module's solution code or hidden tests (lines longer than 25 characters that do
not also appear in the visible part of the instructor's notebook). That folder is what a
course publishes (a public repository, Binder). It fails (exit 1) if anything leaked.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import nbformat

from autograder.paths import REPO, SOLUTIONS, modules

MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
PARTS = ("course", "coursekit", "binder", "deploy", "requirements.txt", "environment.yml", "pyproject.toml")
README = Path(__file__).with_name("STUDENT_README.md")


def secret_lines(module: str) -> set[str]:
    """Lines of ``module``'s solution code and hidden tests that must never reach students.

    Lines of 25 characters or fewer (``return model``) and lines that also occur in the visible
    part of the instructor's notebook are not counted.
    """
    source = nbformat.read(SOLUTIONS / module / f"{module}.ipynb", as_version=4)
    secret = set()
    for cell in source.cells:
        text = cell.source
        for begin, end in (("### BEGIN SOLUTION", "### END SOLUTION"),
                           ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")):
            while begin in text:
                chunk = text.split(begin, 1)[1].split(end, 1)[0]
                secret |= {ln.strip() for ln in chunk.splitlines() if len(ln.strip()) > 25}
                text = text.replace(begin + chunk + end, "")
    visible = {ln.strip() for c in source.cells for ln in c.source.split("### BEGIN")[0].splitlines()}
    return secret - visible


# Plain PyTorch lines that every training loop in the course shows (prerequisites, not any
# exercise's idea): they may appear in scripts although an answer contains them too.
GENERIC = {
    "optimizer.zero_grad()", "loss.backward()", "optimizer.step()", "model.train()", "model.eval()",
    "loss = criterion(model(images), labels)", "criterion = torch.nn.CrossEntropyLoss()",
    "for images, labels in loader:", "with torch.no_grad():", "for epoch in range(config[\"epochs\"]):",
    "with tempfile.TemporaryDirectory() as tmp:", "model.load_state_dict(state)", "for epoch in range(epochs):",
    "torch.manual_seed(config[\"seed\"])", "ray.train.report(metrics, checkpoint=checkpoint)",
    "if dist.is_available() and dist.is_initialized():",
}
ANSWER_MIN = 20   # answer lines longer than this many characters count


def _strip_regions(text: str) -> str:
    """``text`` without its solution and hidden-test regions (an unclosed region runs to the end)."""
    for begin, end in (("### BEGIN SOLUTION", "### END SOLUTION"),
                       ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")):
        while begin in text:
            before, rest = text.split(begin, 1)
            text = before + (rest.split(end, 1)[1] if end in rest else "")
    return text


def _lines(text: str) -> set[str]:
    return {ln.strip() for ln in text.splitlines() if len(ln.strip()) > ANSWER_MIN} - GENERIC


def answers(module: str) -> list[tuple[int, str, set[str]]]:
    """(cell index, grade_id, answer lines) of each solution cell of ``module``'s instructor notebook,
    and of each solution region of its scripts (index -1: they come before every cell)."""
    nb = nbformat.read(SOLUTIONS / module / f"{module}.ipynb", as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and "### BEGIN SOLUTION" in cell.source:
            chunk = cell.source.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
            out.append((i, meta["grade_id"], _lines(chunk)))
    for script in sorted((SOLUTIONS / module).rglob("*.py")):
        text = script.read_text(encoding="utf-8")
        chunks = [c.split("### END SOLUTION", 1)[0] for c in text.split("### BEGIN SOLUTION")[1:]]
        if chunks:
            out.append((-1, script.name, _lines("\n".join(chunks))))
    return out


def answer_leaks(folder: Path, mods: list[str] | None = None) -> list[str]:
    """Lines of any module's answers (solution cells and script solution regions) found in a released
    file that is not a notebook (scripts, coursekit, READMEs), or in a visible cell of the module's
    own notebook above the exercise (an answer printed before the question)."""
    folder = Path(folder)
    course = folder / "course" if (folder / "course").is_dir() else folder
    every = {m: answers(m) for m in mods or modules()}
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".ipynb"):
        try:
            text = _lines(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        for m, items in every.items():
            for _, gid, lines in items:
                hit = sorted(text & lines)
                if hit:
                    found.append(f"{path.relative_to(folder)}: {len(hit)} line(s) of {m}'s answer "
                                 f"{gid}, e.g. {hit[0]!r}")
    for m, items in every.items():
        nb_path = course / m / f"{m}.ipynb"
        if not nb_path.exists():
            continue
        cells = nbformat.read(nb_path, as_version=4).cells
        for index, gid, lines in items:
            above = set()
            for cell in cells[:max(index, 0)]:
                above |= _lines(_strip_regions(cell.source))
            hit = sorted(above & lines)
            if hit:
                found.append(f"{nb_path.relative_to(folder)}: the answer of {gid} is shown above its cell, "
                             f"e.g. {hit[0]!r}")
    return found


def leaks(folder: Path, mods: list[str] | None = None) -> list[str]:
    """What in ``folder`` must not reach students: ["path: what", ...] (empty when clean).

    ``folder`` holds ``course/<module>/<module>.ipynb`` (a release) or is a release root itself.
    Every text file is searched for nbgrader's solution/hidden-test markers; each module's
    released notebook for lines of its own solution code and hidden tests (the same rule as
    tests/test_release.py); and :func:`answer_leaks`: no answer line in any other released file
    or above its exercise; and no instructor-only folder or ``nbgrader_config.py``.
    """
    folder = Path(folder)
    course = folder / "course" if (folder / "course").is_dir() else folder
    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for marker in MARKERS:
            if marker in text:
                found.append(f"{path.relative_to(folder)}: nbgrader marker {marker!r}")
    for m in mods or modules():
        nb_path = course / m / f"{m}.ipynb"
        if not nb_path.exists():
            found.append(f"{nb_path.relative_to(folder)}: missing")
            continue
        public = nbformat.read(nb_path, as_version=4)
        lines = {ln.strip() for c in public.cells for ln in c.source.splitlines()}
        hit = sorted(lines & secret_lines(m))
        if hit:
            found.append(f"{nb_path.relative_to(folder)}: {len(hit)} line(s) of its solutions/hidden "
                         f"tests, e.g. {hit[0]!r}")
    found += answer_leaks(folder, mods)
    for p in folder.rglob("*"):
        if p.name in ("solutions", "autograder", "tests", ".git", "build"):
            found.append(f"{p.relative_to(folder)}: instructor-only folder")
        elif p.name == "nbgrader_config.py":
            found.append(f"{p.relative_to(folder)}: the instructor's nbgrader settings")
    return found


def build(into: Path) -> Path:
    """Write the student copy into ``into`` (replaced)."""
    into = Path(into)
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info", ".*")
    for part in PARTS:
        src = REPO / part
        if src.is_dir():
            shutil.copytree(src, into / part, ignore=ignore)
        elif src.exists():
            shutil.copy(src, into / part)
    shutil.copy(README, into / "README.md")
    (into / "pyproject.toml").write_text(without_instructor_commands((REPO / "pyproject.toml").read_text()))
    return into


def without_instructor_commands(pyproject: str) -> str:
    """``pyproject`` without its ``[project.scripts]`` table (and the comment above it): those commands run
    autograder/ and bench/, which the release does not have."""
    lines = pyproject.splitlines(keepends=True)
    if "[project.scripts]\n" not in lines:
        return pyproject
    start = end = lines.index("[project.scripts]\n")
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    end += 1
    while end < len(lines) and not lines[end].startswith("["):
        end += 1
    return "".join(lines[:start] + lines[end:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--into", type=Path, default=REPO / "build" / "student-release")
    args = p.parse_args(argv)
    missing = set(modules()) - {d.name for d in (REPO / "course").iterdir() if d.is_dir()}
    if missing:
        print(f"error: course/ lacks {', '.join(sorted(missing))}: run `make assignments`", file=sys.stderr)
        return 1
    out = build(args.into)
    problems = leaks(out)
    if problems:
        print("error: the student release contains instructor-only text:", *problems[:20], sep="\n  ",
              file=sys.stderr)
        return 1
    n = sum(1 for p in out.rglob("*") if p.is_file())
    print(f"student release: {out} ({n} files, modules {', '.join(modules())}); "
          "no solution code and no hidden tests in it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
