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
import ast
import shutil
import sys
import textwrap
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


# ---------------------------------------------------------------- answers by their shape

SHAPE_MIN = 15       # AST nodes: smaller statements (`loss.backward()`, `model = DDP(model)`) are every loop's
SHAPE_WHOLE = 40     # a statement this large matching alone is a leak (a loop, a function body)
SHAPE_SHARE = 0.5    # else: this share of an answer's shapes in one file (at least 2 of them)


class _Abstract(ast.NodeTransformer):
    """Names, arguments and literals abstracted: what a statement does, whatever its variables are called.
    Attributes and keywords stay (``dist.all_reduce``, ``broadcast_from_rank0=``): they are the API."""

    def visit_Name(self, node):
        return ast.copy_location(ast.Name(id="_", ctx=node.ctx), node)

    def visit_arg(self, node):
        node.arg, node.annotation = "_", None
        return node

    def visit_Constant(self, node):
        return ast.copy_location(ast.Constant(value=type(node.value).__name__), node)

    def visit_FunctionDef(self, node):
        self.generic_visit(node)
        node.name, node.returns = "_", None
        return node

    def visit_Expr(self, node):      # docstrings and other bare strings say nothing about the code
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return ast.Pass()
        return self.generic_visit(node)


def _parse(text: str) -> ast.Module | None:
    text = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith(("%", "!")))
    for candidate in (text, textwrap.dedent(text)):
        try:
            return ast.parse(candidate)
        except SyntaxError:
            continue
    return None


def shapes(text: str) -> dict[str, tuple[int, str]]:
    """shape -> (AST nodes, first line) of every statement of ``text`` (at any depth, imports aside) of at least
    ``SHAPE_MIN`` nodes, with names and literals abstracted: a copy with its variables renamed has the same
    shapes. Text that does not parse has none."""
    tree = _parse(text)
    out: dict[str, tuple[int, str]] = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.Import, ast.ImportFrom)):
            size = sum(1 for _ in ast.walk(node))
            if size >= SHAPE_MIN:
                source = ast.unparse(node)
                key = ast.dump(_Abstract().visit(ast.parse(source).body[0]), annotate_fields=False)
                out.setdefault(key, (size, source.splitlines()[0][:100]))
    return out


def shape_leak(answer: dict[str, tuple[int, str]], text_shapes: dict) -> str:
    """Why ``text_shapes`` hold the answer whose shapes are ``answer`` ("" when they do not): one large
    statement of it, or ``SHAPE_SHARE`` of its statements, whatever the names."""
    hit = [answer[k] for k in answer if k in text_shapes]
    whole = [h for h in hit if h[0] >= SHAPE_WHOLE]
    if whole:
        return f"a statement of {whole[0][0]} AST nodes with the answer's shape, e.g. {whole[0][1]!r}"
    if len(hit) >= 2 and len(hit) >= SHAPE_SHARE * len(answer):
        return f"{len(hit)} of the answer's {len(answer)} statements by shape, e.g. {hit[0][1]!r}"
    return ""


def answers(module: str) -> list[tuple[int, str, set[str], dict]]:
    """(cell index, grade_id, answer lines, answer shapes) of each solution cell of ``module``'s instructor
    notebook, and of each script's solution regions (index -1: they come before every cell)."""
    nb = nbformat.read(SOLUTIONS / module / f"{module}.ipynb", as_version=4)
    out = []
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and "### BEGIN SOLUTION" in cell.source:
            chunk = cell.source.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
            out.append((i, meta["grade_id"], _lines(chunk), shapes(chunk)))
    for script in sorted((SOLUTIONS / module).rglob("*.py")):
        text = script.read_text(encoding="utf-8")
        chunks = [c.split("### END SOLUTION", 1)[0] for c in text.split("### BEGIN SOLUTION")[1:]]
        if chunks:
            out.append((-1, script.name, _lines("\n".join(chunks)),
                        {k: v for c in chunks for k, v in shapes(c).items()}))
    return out


def _owner(path: Path, course: Path) -> str | None:
    """The module whose release folder holds ``path`` (None: a file every module's students get)."""
    try:
        return path.relative_to(course).parts[0] if path.is_relative_to(course) else None
    except IndexError:
        return None


def _leak(text_lines: set[str], text_shapes: dict, lines: set[str], answer_shapes: dict) -> str:
    """Why a text (its ``_lines`` and ``shapes``) holds an answer (its lines and shapes); "" when it does not."""
    hit = sorted(text_lines & lines)
    if hit:
        return f"{len(hit)} line(s), e.g. {hit[0]!r}"
    return shape_leak(answer_shapes, text_shapes)


def answer_leaks(folder: Path, mods: list[str] | None = None) -> list[str]:
    """Answers (solution cells and script solution regions, by their lines or by their shape, whatever the
    names) found where a student of a module could read them before its deadline.

    A module is released after the deadline of every module before it (``make release THROUGH=...``), so a file
    of module j's folder may hold the answers of modules before j (module 07's scripts do 01's, 05's and 06's
    jobs) but never of j or a later module; a file outside the modules' folders (coursekit, READMEs, deploy) holds
    no answer; a released notebook shows none of its own answers above their exercise, and none of a later
    module's anywhere."""
    folder = Path(folder)
    course = folder / "course" if (folder / "course").is_dir() else folder
    order = modules()
    every = {m: answers(m) for m in mods or order}

    def later_or_same(m: str, owner: str | None) -> bool:
        return owner is None or owner not in order or order.index(m) >= order.index(owner)

    found = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".ipynb"):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        owner, text_lines, text_shapes = _owner(path, course), _lines(text), shapes(text)
        for m, items in every.items():
            if not later_or_same(m, owner):
                continue
            for _, gid, lines, answer_shapes in items:
                # a later module's answer in a module's folder: by shape only (single lines such as
                # `images, labels = images.to(device), labels.to(device)` are every module's)
                why = _leak(text_lines if owner in (None, m) else set(), text_shapes, lines, answer_shapes)
                if why:
                    found.append(f"{path.relative_to(folder)}: {m}'s answer {gid}: {why}")
    for owner in order:
        nb_path = course / owner / f"{owner}.ipynb"
        if not nb_path.exists():
            continue
        cells = [_strip_regions(c.source) for c in nbformat.read(nb_path, as_version=4).cells]
        cell_lines, cell_shapes = [_lines(c) for c in cells], [shapes(c) for c in cells]
        for m, items in every.items():
            if order.index(m) < order.index(owner):
                continue
            for index, gid, lines, answer_shapes in items:
                # its own answers: by line or shape, above the exercise; a later module's: by shape, anywhere
                # (lines such as `for images, labels in batches:` are every module's)
                upto = max(index, 0) if m == owner else len(cells)
                why = next((w for t, sh in zip(cell_lines[:upto], cell_shapes[:upto])
                            if (w := _leak(t if m == owner else set(), sh, lines, answer_shapes))), "")
                if why:
                    where = "above its cell" if m == owner else f"in {owner}, before {m}'s deadline"
                    found.append(f"{nb_path.relative_to(folder)}: the answer of {m}'s {gid} is shown {where}: {why}")
    return found


def judged_texts(mods: list[str] | None = None) -> list[tuple[str, str]]:
    """(grade_id, the first 60 characters of its explanation) of each concept key the grader holds
    (autograder/checks/concepts.py): text that names the right answer."""
    from autograder.checks.concepts import KEYS

    return [(gid, why[:60]) for m in mods or modules() for gid, (_, why, _) in KEYS.get(m, {}).items()]


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
        for gid, why in judged_texts(mods):      # the grader's explanations of the concept keys
            if why in text:
                found.append(f"{path.relative_to(folder)}: the grader's explanation of {gid}")
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
    found += answer_leaks(folder)      # every module's answers: an unreleased one's above all
    for p in folder.rglob("*"):
        if p.name in ("solutions", "autograder", "tests", ".git", "build"):
            found.append(f"{p.relative_to(folder)}: instructor-only folder")
        elif p.name == "nbgrader_config.py":
            found.append(f"{p.relative_to(folder)}: the instructor's nbgrader settings")
    return found


def released_through(through: str | None = None) -> list[str]:
    """The modules a class has been given when ``through`` opens (all of them: None)."""
    order = modules()
    if through is None:
        return order
    if through not in order:
        raise SystemExit(f"error: no module {through!r}; the modules are {', '.join(order)}")
    return order[: order.index(through) + 1]


def build(into: Path, through: str | None = None) -> Path:
    """Write the student copy into ``into`` (replaced): the modules up to ``through`` (default: all)."""
    into = Path(into)
    if into.exists():
        shutil.rmtree(into)
    into.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints", "*.egg-info", ".*")
    given = released_through(through)
    for part in PARTS:
        src = REPO / part
        if part == "course":
            for m in given:
                shutil.copytree(src / m, into / part / m, ignore=ignore)
        elif src.is_dir():
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
    p.add_argument("--through", default=None, metavar="MODULE",
                   help="release the modules up to this one (a class that opens one module at a time, each "
                        "after the deadline of the one before); default: all of them")
    args = p.parse_args(argv)
    missing = set(modules()) - {d.name for d in (REPO / "course").iterdir() if d.is_dir()}
    if missing:
        print(f"error: course/ lacks {', '.join(sorted(missing))}: run `make assignments`", file=sys.stderr)
        return 1
    out = build(args.into, args.through)
    problems = leaks(out, released_through(args.through))
    if problems:
        print("error: the student release contains instructor-only text:", *problems[:20], sep="\n  ",
              file=sys.stderr)
        return 1
    n = sum(1 for p in out.rglob("*") if p.is_file())
    print(f"student release: {out} ({n} files, modules {', '.join(released_through(args.through))}); "
          "no solution code and no hidden tests in it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
