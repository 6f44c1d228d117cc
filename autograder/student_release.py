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
not also appear in the visible part of the instructor's notebooks). That folder is what a
course publishes (a public repository, Binder). It fails (exit 1) if anything leaked.
"""
from __future__ import annotations

import argparse
import ast
import functools
import builtins
import shutil
import sys
import textwrap
from collections import Counter
from pathlib import Path

import nbformat

from autograder.paths import REPO, SOLUTIONS, module_cells, modules, notebook_of, notebooks

MARKERS = ("BEGIN SOLUTION", "END SOLUTION", "BEGIN HIDDEN TESTS", "END HIDDEN TESTS")
PARTS = ("course", "coursekit", "binder", "deploy", "requirements.txt", "environment.yml", "pyproject.toml")
README = Path(__file__).with_name("STUDENT_README.md")


def _released_notebooks(course: Path, module: str) -> list[Path]:
    """The released notebooks of ``module`` under ``course`` (a release's course/ folder) that exist."""
    return [p for name in notebooks(module) if (p := course / module / f"{name}.ipynb").exists()]


def secret_lines(module: str) -> set[str]:
    """Lines of ``module``'s solution code and hidden tests that must never reach students.

    Lines of 25 characters or fewer (``return model``) and lines that also occur in the visible
    part of the instructor's notebooks (all of the module's) are not counted.
    """
    cells = module_cells(module)
    secret = set()
    for cell in cells:
        text = cell.source
        for begin, end in (("### BEGIN SOLUTION", "### END SOLUTION"),
                           ("### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS")):
            while begin in text:
                chunk = text.split(begin, 1)[1].split(end, 1)[0]
                secret |= {ln.strip() for ln in chunk.splitlines() if len(ln.strip()) > 25}
                text = text.replace(begin + chunk + end, "")
    visible = {ln.strip() for c in cells for ln in c.source.split("### BEGIN")[0].splitlines()}
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
    "fully_shard(model, mesh=mesh)", "model = build_vit_from(config)",     # module 05's every sharding, its model
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


def shapes(text: str, smallest: int = SHAPE_MIN) -> dict[str, tuple[int, str]]:
    """shape -> (AST nodes, first line) of every statement of ``text`` (at any depth, imports aside) of at least
    ``SHAPE_MIN`` nodes, with names and literals abstracted: a copy with its variables renamed has the same
    shapes. Text that does not parse has none."""
    tree = _parse(text)
    out: dict[str, tuple[int, str]] = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.Import, ast.ImportFrom)):
            size = sum(1 for _ in ast.walk(node))
            if size >= smallest:
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


# ---------------------------------------------------------------- answers by their tokens and their key calls
#
# Measured on the release of 2026-11-27 (issue 38's cases): module 07's script held its capstone's train_func at a
# token coverage of 0.74 (the answer's abstracted tokens found, in order, in blocks of 4 or more, in one function),
# module 03's script its train_func at 0.70; the most any other unit of the release reached for an answer that long
# was 0.58 (07's DeepSpeed script, a sibling port). Short answers are all alike by tokens, so they are compared by
# their key calls: a call of 3 or more arguments (module 02's ScalingConfig(num_workers=, use_gpu=,
# resources_per_worker=), 05's StateDictOptions(full_state_dict=, cpu_offload=) and init_device_mesh(..., (.., ..),
# mesh_dim_names=)) or a dict of 3 or more string keys (06's DeepSpeed config), found with the same callee and at
# least the same keywords, unless an earlier module's release already shows that call (then it is a prerequisite).

TOKENS_MIN = 150        # answers this long are compared by token coverage
TOKENS_SHARE = 0.65     # ... and leak where one function, cell or script holds this share of them
KEY_ARGS = 2            # a call with this many keyword arguments is a key call (its options are what an exercise asks)
KEY_KEYS = 3            # a dict literal with this many string keys is one too


class _KeepCallees(_Abstract):
    """:class:`_Abstract`, but a called name stays (``ScalingConfig(...)``, ``init_device_mesh(...)``): it is the API."""

    def visit_Call(self, node):
        callee = node.func.id if isinstance(node.func, ast.Name) else None
        self.generic_visit(node)
        if callee:
            node.func = ast.Name(id=callee, ctx=ast.Load())
        return node


def tokens(tree: ast.AST) -> list[str]:
    """The tokens of ``tree`` with names and literals abstracted (called names kept)."""
    import io
    import tokenize

    source = ast.unparse(_KeepCallees().visit(ast.parse(ast.unparse(tree))))
    return [t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
            if t.type in (tokenize.NAME, tokenize.OP, tokenize.STRING, tokenize.NUMBER)]


def units(text: str) -> list[list[str]]:
    """The token lists of each function of ``text`` (its body) and of its top level: where an answer would sit."""
    tree = _parse(text)
    if tree is None:
        return []
    bodies = [node.body for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    bodies.append([n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                                              ast.Import, ast.ImportFrom))])
    return [t for body in bodies if body and (t := tokens(ast.Module(body=body, type_ignores=[])))]


def coverage(answer: list[str], unit: list[str]) -> float:
    """The share of ``answer``'s tokens found in ``unit`` in order, in runs of 4 or more."""
    import difflib

    blocks = difflib.SequenceMatcher(None, answer, unit, autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks if b.size >= 4) / max(len(answer), 1)


def _callee(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _literal(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) or (isinstance(node, (ast.Tuple, ast.List))
                                              and all(isinstance(e, ast.Constant) for e in node.elts))


def _keywords(call: ast.Call) -> frozenset[str]:
    """A call's keyword names; a keyword given a literal (``mesh_dim_names=("replicate", "shard")``) with its value."""
    return frozenset(f"{k.arg}={ast.unparse(k.value)}" if _literal(k.value) else k.arg for k in call.keywords if k.arg)


def key_calls(text: str) -> dict[tuple, str]:
    """(callee, positional arguments, keywords) of each call of ``text`` with ``KEY_ARGS`` keyword arguments or more,
    or with ``KEY_ARGS + 1`` arguments one of which a keyword given a literal; and ("{}", 0, keys) of each dict (a
    literal or ``dict(...)``) with ``KEY_KEYS`` string keys or more -> its source."""
    tree = _parse(text)
    out: dict[tuple, str] = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and _callee(node.func) == "dict" and not node.args:
            keys = frozenset(k.arg for k in node.keywords if k.arg)
            if len(keys) >= KEY_KEYS:
                out.setdefault(("{}", 0, keys), ast.unparse(node)[:100])
        elif isinstance(node, ast.Call) and _callee(node.func):
            named = [k for k in node.keywords if k.arg]
            if len(named) >= KEY_ARGS or (any(_literal(k.value) for k in named)
                                          and len(node.args) + len(named) > KEY_ARGS):
                out.setdefault((_callee(node.func), len(node.args), _keywords(node)), ast.unparse(node)[:100])
        elif isinstance(node, ast.Dict):
            keys = frozenset(k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str))
            if len(keys) >= KEY_KEYS:
                out.setdefault(("{}", 0, keys), ast.unparse(node)[:100])
    return out


DICT_SHARE = 0.6         # a dict holding this share of an answer dict's keys (3 or more) is that dict


def _calls_found(answer: dict[tuple, str], text: dict[tuple, str]) -> list[str]:
    """The answer's calls that ``text`` makes too: the same callee (and positional count) with the answer's keywords
    or more (a keyword given a literal: with the same value); a dict with ``DICT_SHARE`` of the answer dict's keys."""
    def same(callee, npos, kws, c, n, k):
        if callee == "{}":
            return c == "{}" and len(kws & k) >= KEY_KEYS and len(kws & k) >= DICT_SHARE * len(kws)
        return c == callee and n == npos and kws <= k

    return [src for (callee, npos, kws), src in answer.items() if any(same(callee, npos, kws, *t) for t in text)]


NOVEL_MIN = 10           # AST nodes: a statement this large, new since the earlier modules, is the answer's own
NOVEL_CALLS = 2          # a file (a script, coursekit, a figure) that makes this many of an answer's new calls holds it


_BUILTINS = set(dir(builtins)) | {""}


def calls(tree: ast.AST | None) -> dict[tuple, str]:
    """(callee, positional arguments, keywords) of every call with an argument -> its source: an answer's API use
    (``ray.train.get_dataset_shard("train")``, ``.iter_torch_batches(batch_size=...)``), whatever its values."""
    out: dict[tuple, str] = {}
    for node in ast.walk(tree) if tree else ():
        if isinstance(node, ast.Call) and _callee(node.func) not in _BUILTINS and (node.args or node.keywords):
            out.setdefault((_callee(node.func), len(node.args), _keywords(node)), ast.unparse(node)[:100])
    return out


def svg_text(svg: str) -> str:
    """The text a figure shows, one ``<text>`` element per line."""
    import html
    import re

    return "\n".join(html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg))


class Code:
    """What the leak rules compare of a text: its long lines, statement shapes, units' tokens and key calls."""

    def __init__(self, text: str, figure: bool = False):
        if figure:                      # a figure's lines are separate statements, each parsed alone
            parts = [ln.strip() for ln in text.splitlines()]
            self.shapes = {k: v for p in parts for k, v in shapes(p, NOVEL_MIN).items()}
            self.units = [sum((tokens(t) for p in parts if (t := _parse(p))), [])]
            self.calls = {k: v for p in parts for k, v in key_calls(p).items()}
            self.api = {k: v for p in parts for k, v in calls(_parse(p)).items()}
        else:
            tree = _parse(text)
            self.shapes, self.units, self.calls = shapes(text, NOVEL_MIN), units(text), key_calls(text)
            self.api = calls(tree)
        self.lines = _lines(text)
        self.code = not figure
        self.unit_counts = [Counter(u) for u in self.units]


@functools.lru_cache(maxsize=None)
def code_of(text: str, figure: bool = False) -> Code:
    """``Code(text, figure)``, made once per text: the check reads each module's released cells again for every
    later module (read-only, shared)."""
    return Code(text, figure)


def _answer_code(chunk: str) -> tuple[list[str], dict, dict, dict]:
    """An answer's tokens, key calls, statement shapes down to ``NOVEL_MIN`` nodes, and every call it makes."""
    tree = _parse(chunk)
    return (tokens(tree) if tree else []), key_calls(chunk), shapes(chunk, NOVEL_MIN), calls(tree)


def answer_entry(chunk: str, grade_id: str, index: int = -1) -> tuple:
    """An answer as :func:`answers` lists it, from its code."""
    return (index, grade_id, _lines(chunk), shapes(chunk), *_answer_code(chunk))


def answers(module: str) -> list[tuple]:
    """(cell index, grade_id, answer lines, answer shapes, tokens, key calls, small shapes, calls) of each solution cell of
    ``module``'s instructor notebooks (the index is in the notebook that holds the grade_id:
    ``autograder.paths.notebook_of``), and of each script's solution regions (index -1: they come before every
    cell)."""
    out = []
    for name in notebooks(module):
        nb = nbformat.read(SOLUTIONS / module / f"{name}.ipynb", as_version=4)
        for i, cell in enumerate(nb.cells):
            meta = cell.metadata.get("nbgrader", {})
            if meta.get("solution") and "### BEGIN SOLUTION" in cell.source:
                chunk = cell.source.split("### BEGIN SOLUTION", 1)[1].split("### END SOLUTION", 1)[0]
                out.append(answer_entry(chunk, meta["grade_id"], i))
    for script in sorted((SOLUTIONS / module).rglob("*.py")):
        text = script.read_text(encoding="utf-8")
        chunks = [c.split("### END SOLUTION", 1)[0] for c in text.split("### BEGIN SOLUTION")[1:]]
        if chunks:
            parts = [_answer_code(c) for c in chunks]
            out.append((-1, script.name, _lines("\n".join(chunks)),
                        {k: v for c in chunks for k, v in shapes(c).items()},
                        [t for part in parts for t in part[0]], {k: v for part in parts for k, v in part[1].items()},
                        {k: v for part in parts for k, v in part[2].items()},
                        {k: v for part in parts for k, v in part[3].items()}))
    return out


def _owner(path: Path, course: Path) -> str | None:
    """The module whose release folder holds ``path`` (None: a file every module's students get)."""
    try:
        return path.relative_to(course).parts[0] if path.is_relative_to(course) else None
    except IndexError:
        return None


def _leak(text: Code, answer: tuple, lines: bool, known: "Known", file: bool = False) -> str:
    """Why ``text`` holds ``answer`` (an entry of :func:`answers`); "" when it does not. ``lines``: compare long lines
    too (a later module's single lines, such as `for images, labels in batches:`, are every module's); ``known``:
    key calls an earlier module's release already shows."""
    _, _, answer_lines, answer_shapes, answer_tokens, answer_calls, small_shapes, answer_api = answer
    hit = sorted(text.lines & answer_lines) if lines else []
    if hit:
        return f"{len(hit)} line(s), e.g. {hit[0]!r}"
    why = shape_leak(answer_shapes, text.shapes)
    if why:
        return why
    if len(answer_tokens) >= TOKENS_MIN:
        # a unit sharing fewer tokens than the threshold (as multisets) cannot cover that many in order: not compared
        need, counts = TOKENS_SHARE * len(answer_tokens), Counter(answer_tokens)
        best = max((coverage(answer_tokens, u) for u, c in zip(text.units, text.unit_counts)
                    if (counts & c).total() >= need), default=0.0)
        if best >= TOKENS_SHARE:
            return f"{best:.0%} of the answer's {len(answer_tokens)} tokens in one function, in order, whatever the names"
    found = _calls_found({k: v for k, v in answer_calls.items() if not _calls_found({k: v}, known.calls)}, text.calls)
    if found:
        return f"its key call {found[0]!r}"
    novel = [v for k, v in small_shapes.items() if k in text.shapes and k not in known.shapes]
    if len(novel) >= 2:
        return f"{len(novel)} of its statements new since the earlier modules, by shape, e.g. {novel[0][1]!r}"
    if file or text.code:
        new = _calls_found({k: v for k, v in answer_api.items() if not _calls_found({k: v}, known.api)}, text.api)
        if len(new) >= NOVEL_CALLS:
            return f"{len(new)} of its calls that no earlier module makes, e.g. {new[0]!r} and {new[1]!r}"
    return ""


class Known:
    """What the releases of the modules before one show (prerequisites, not answers): key calls, shapes, calls."""

    def __init__(self, codes: list[Code]):
        self.calls = {k: v for c in codes for k, v in c.calls.items()}
        self.shapes = {k for c in codes for k in c.shapes}
        self.api = {k: v for c in codes for k, v in c.api.items()}

    def with_(self, other: "Known") -> "Known":
        both = Known([])
        both.calls, both.shapes, both.api = {**self.calls, **other.calls}, self.shapes | other.shapes, {**self.api, **other.api}
        return both


@functools.lru_cache(maxsize=None)
def known_before(module: str, course: Path = REPO / "course") -> Known:
    """What the released folders of the modules before ``module`` show (their notebooks' cells and their files)."""
    order = modules()
    codes = []
    for earlier in order[: order.index(module)]:
        codes += [_cell_code(c) for path in _released_notebooks(course, earlier)
                  for c in nbformat.read(path, as_version=4).cells]
        for path in sorted((course / earlier).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".svg", ".sh"):
                text = path.read_text(encoding="utf-8")
                codes.append(code_of(svg_text(text), figure=True) if path.suffix == ".svg" else code_of(text))
    return Known(codes)


def leak_of(answer_code: str, text: str, module: str, kind: str = "file") -> str:
    """Why ``text`` (``kind``: "file", "figure", "code cell" or "markdown cell" of the release) holds the answer
    ``answer_code`` of ``module`` ("" when it does not), as :func:`answer_leaks` judges it in that module's folder."""
    code = {"file": lambda: Code(text), "figure": lambda: Code(svg_text(text), figure=True),
            "code cell": lambda: Code(_strip_regions(text)),
            "markdown cell": lambda: Code(_markdown_code(text), figure=True)}[kind]()
    return _leak(code, answer_entry(answer_code, "answer"), True, known_before(module), file=kind in ("file", "figure"))


def _markdown_code(source: str) -> str:
    """The code a markdown cell shows: its fenced blocks, its indented blocks (lines of 4 spaces or a tab, shown as
    code), and each inline code span on a line of its own."""
    import re
    import textwrap

    fenced = re.findall(r"```[a-z]*\n(.*?)```", source, re.S)
    rest = re.sub(r"```.*?```", "", source, flags=re.S)
    indented = re.findall(r"(?:^(?: {4}|\t).*\n?)+", rest, re.M)
    inline = re.findall(r"`([^`\n]+)`", rest)
    return "\n".join([*fenced, *(textwrap.dedent(block) for block in indented), *inline])


def _cell_code(cell) -> Code:
    if cell.cell_type == "markdown":
        return code_of(_markdown_code(cell.source), figure=True)
    return code_of(_strip_regions(cell.source))


def answer_leaks(folder: Path, mods: list[str] | None = None) -> list[str]:
    """Answers (solution cells and script solution regions: by their lines, their statements' shapes, their tokens or
    their key calls, whatever the names) found where a student of a module could read them before its deadline.

    A module is released after the deadline of every module before it (``make release THROUGH=...``), so a file
    of module j's folder may hold the answers of modules before j (module 07's scripts do 01's, 05's and 06's
    jobs) but never of j or a later module; a file outside the modules' folders (coursekit, READMEs, deploy) holds
    no answer; a module's released notebooks (all of them are that module's) show none of its answers outside their
    cells (a student reads the whole notebook), and none of a later module's anywhere. Figures are read by the text they show."""
    folder = Path(folder)
    course = folder / "course" if (folder / "course").is_dir() else folder
    order = modules()
    every = {m: answers(m) for m in mods or order}
    # (module, notebook) -> its cells: every notebook of a module is that module's
    released = {(o, path.stem): [_cell_code(c) for c in nbformat.read(path, as_version=4).cells]
                for o in order for path in _released_notebooks(course, o)}
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix != ".ipynb"):
        try:
            text = path.read_text(encoding="utf-8")
            files[path] = code_of(svg_text(text), figure=True) if path.suffix == ".svg" else code_of(text)
        except (UnicodeDecodeError, OSError):
            continue

    def known(m: str) -> Known:
        """The earlier modules' releases: this folder's and the course's own (a folder may hold only some)."""
        earlier = order[: order.index(m)] if m in order else []
        here = Known([c for (o, _), cells in released.items() if o in earlier for c in cells]
                     + [c for path, c in files.items() if _owner(path, course) in earlier])
        return here.with_(known_before(m)) if m in order and (REPO / "course" / m).is_dir() else here

    def later_or_same(m: str, owner: str | None) -> bool:
        return owner is None or owner not in order or order.index(m) >= order.index(owner)

    found = []
    for m, items in every.items():
        prerequisites = known(m)
        for path, code in files.items():
            owner = _owner(path, course)
            if later_or_same(m, owner):
                for answer in items:
                    why = _leak(code, answer, owner in (None, m), prerequisites, file=True)
                    if why:
                        found.append(f"{path.relative_to(folder)}: {m}'s answer {answer[1]}: {why}")
        for (owner, name), cells in released.items():
            if order.index(m) < order.index(owner):
                continue
            nb_path = (course / owner / f"{name}.ipynb").relative_to(folder)
            where = "outside its cell" if m == owner else f"in {owner}, before {m}'s deadline"
            for answer in items:      # every cell that shows it: one reviewed cell never hides another
                own = m == owner and answer[0] >= 0 and notebook_of(m, answer[1], default=None) == name    # the answer's notebook
                for i, c in enumerate(cells):
                    if not (own and i == answer[0]) and (why := _leak(c, answer, m == owner, prerequisites)):
                        found.append(f"{nb_path}: the answer of {m}'s {answer[1]} is shown {where}: cell {i}: {why}")
    return found


REVIEWED = Path(__file__).with_name("leaks_reviewed.toml")


def reviewed() -> list[dict]:
    """The findings of :func:`answer_leaks` that an instructor reviewed and kept (``autograder/leaks_reviewed.toml``):
    each names the answer ("module/grade_id"), the released file, a piece of the finding (``shows``) and why it gives
    nothing away (a teaching cell that introduces the API the exercise then combines with others, ...)."""
    import tomllib

    if not REVIEWED.exists():
        return []
    entries = tomllib.loads(REVIEWED.read_text())["reviewed"]
    for e in entries:
        missing = {"answer", "where", "shows", "reason"} - set(e)
        if missing or len(e["reason"]) < 40:
            raise ValueError(f"{REVIEWED.name}: an entry needs answer, where, shows and a reason: {e}")
    return entries


def unreviewed(found: list[str]) -> list[str]:
    """``found`` without the findings that :func:`reviewed` keeps."""
    keep = reviewed()

    def kept(finding: str) -> bool:
        path = finding.split(":", 1)[0].removeprefix("course/")      # a release root, or its course/ folder
        return any(path == e["where"].removeprefix("course/") and e["shows"] in finding
                   and (f"{e['answer'].replace('/', chr(39) + 's answer ')}:" in finding
                        or f"{e['answer'].replace('/', chr(39) + 's ')} is shown" in finding) for e in keep)
    return [f for f in found if not kept(f)]


def judged_texts(mods: list[str] | None = None) -> list[tuple[str, str]]:
    """(grade_id, the first 60 characters of its explanation) of each concept key the grader holds
    (autograder/checks/concepts.py): text that names the right answer."""
    from autograder.checks.concepts import KEYS

    return [(gid, why[:60]) for m in mods or modules() for gid, (_, why, _) in KEYS.get(m, {}).items()]


def leaks(folder: Path, mods: list[str] | None = None) -> list[str]:
    """What in ``folder`` must not reach students: ["path: what", ...] (empty when clean).

    ``folder`` holds ``course/<module>/<module>.ipynb`` (a release) or is a release root itself.
    Every text file is searched for nbgrader's solution/hidden-test markers; each module's
    released notebooks for lines of its own solution code and hidden tests (the same rule as
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
        for name in notebooks(m):
            nb_path = course / m / f"{name}.ipynb"
            if not nb_path.exists():
                found.append(f"{nb_path.relative_to(folder)}: missing")
                continue
            public = nbformat.read(nb_path, as_version=4)
            lines = {ln.strip() for c in public.cells for ln in c.source.splitlines()}
            hit = sorted(lines & secret_lines(m))
            if hit:
                found.append(f"{nb_path.relative_to(folder)}: {len(hit)} line(s) of its solutions/hidden "
                             f"tests, e.g. {hit[0]!r}")
    found += unreviewed(answer_leaks(folder))      # every module's answers: an unreleased one's above all
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
