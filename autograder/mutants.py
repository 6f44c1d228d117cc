"""Mutation testing of the grader's checks: how many wrong answers each exercise's checks catch.

``python -m autograder.mutants [MODULE ...] [--exercise NAME] [--out DIR]`` (``make mutants MODULE=05_fsdp2``):
for every code exercise of a module, mutants of its reference answer (the solutions notebook's answer cell, one
small change each: ``operators``) are graded the way a submission is, and each one's verdict is recorded:

- **killed**: at least one of the exercise's graded cells fails (the message a student would read is kept), or
  the answer cell itself raises, or the kernel dies (nbgrader then scores the whole notebook 0);
- **survived**: every graded cell of the exercise passes, as it does for the reference;
- **equivalent**: survived, and listed in ``autograder/checks/equivalent/MODULE.toml`` with the reason it
  computes the same thing as the reference (reviewed by a person, like any code);
- **timeout**: a cell ran past the limit. Never a verdict: it counts against the exercise, like a survivor.

How: one kernel (the course's, in grading mode, asked the hidden cases: as ``autograder.job`` runs one) executes
the solutions notebook in order (a module of several notebooks: each in a kernel of its own, as nbgrader grades
them). At an exercise it runs the reference answer and the cells after it up to the
exercise's last test cell, and checks that the reference passes; then for each mutant it removes the names the
answer defines, runs the mutant in place of the answer and the same following cells again, and judges each test
cell's handed-in data in this process (``autograder.checks.judge``: the grader's own verdict, never the kernel's);
then the reference runs again, so that later exercises start from the state a correct answer leaves.

The mutants: a selection of cosmic-ray's operators (numbers, comparisons, booleans, arithmetic, loops), and the
operators of this domain written here: names swapped (global and local rank, world size, sum and mean, ...), a
keyword argument dropped or set to None, 0 or 1, a seed changed, a call statement removed (``set_epoch``, a barrier,
``to_empty``, a seed, ``fully_shard``, ...), two neighbouring statements swapped, an accumulator hoisted out of its
loop, a literal tuple reversed (a mesh's dimensions), ``as_directory()`` replaced by ``.path``, the workers' device
replaced by the driver's, a full state dict where a sharded one is expected.
"""
from __future__ import annotations

import argparse
import ast
import copy
import difflib
import json
import os
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from autograder.paths import notebook_of, notebooks
from coursekit.paths import REPO

EQUIVALENT = REPO / "autograder" / "checks" / "equivalent"     # MODULE.toml: the reviewed equivalents of a module
OUT = REPO / "build" / "mutants"
CELL_LIMIT_S = 240          # a mutant's cell that runs longer is stopped: a "timeout", counted against the exercise

# cosmic-ray's operators that make the mistakes a student makes (its other binary and comparison replacements,
# bitwise and shifts, make code no student writes)
COSMIC = ["core/NumberReplacer", "core/ReplaceTrueWithFalse", "core/ReplaceFalseWithTrue", "core/ReplaceAndWithOr",
          "core/ReplaceOrWithAnd", "core/AddNot", "core/ZeroIterationForLoop", "core/ReplaceBreakWithContinue",
          "core/ReplaceBinaryOperator_Add_Sub", "core/ReplaceBinaryOperator_Sub_Add",
          "core/ReplaceBinaryOperator_Mul_Div", "core/ReplaceBinaryOperator_Div_Mul",
          "core/ReplaceBinaryOperator_Div_FloorDiv", "core/ReplaceBinaryOperator_FloorDiv_Div",
          "core/ReplaceBinaryOperator_Mod_FloorDiv", "core/ReplaceComparisonOperator_Lt_LtE",
          "core/ReplaceComparisonOperator_LtE_Lt", "core/ReplaceComparisonOperator_Gt_GtE",
          "core/ReplaceComparisonOperator_GtE_Gt", "core/ReplaceComparisonOperator_Eq_NotEq",
          "core/ReplaceComparisonOperator_NotEq_Eq", "core/ReplaceComparisonOperator_Is_IsNot",
          "core/ReplaceComparisonOperator_IsNot_Is"]

# names a student confuses: each is replaced by the other (a Name, an attribute, or a string constant)
SWAPS = [("rank", "local_rank"), ("get_rank", "get_local_rank"), ("world_rank", "local_rank"),
         ("get_world_rank", "get_local_rank"), ("world_size", "local_world_size"),
         ("get_world_size", "get_local_world_size"), ("sum", "mean"), ("SUM", "AVG"), ("AdamW", "Adam"),
         ("train", "eval"), ("min", "max"), ("reshard_after_forward", "reshard_after_backward"),
         ("get_model_state_dict", "get_state_dict"), ("set_model_state_dict", "set_state_dict"),
         ("float32", "bfloat16"), ("param_dtype", "reduce_dtype"), ("shard", "replicate"),
         ("dp_shard", "dp_replicate")]
SWAP = {a: b for a, b in SWAPS} | {b: a for a, b in SWAPS}
CHECKPOINT_NAMES = ("checkpoint", "ckpt")


@dataclass
class Mutant:
    operator: str
    source: str
    diff: str                       # the changed lines, "-old" and "+new"

    @property
    def key(self) -> str:
        return f"{self.operator}: {self.diff}"


@dataclass
class Exercise:
    name: str                       # the answer cell's grade_id
    answer: int                     # its index in the notebook
    last: int                       # the index of its last test cell
    tests: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------- operators

class _Once(ast.NodeTransformer):
    """Applies ``change`` to the ``target``-th node that ``change`` can change (None: it cannot); counts them all."""

    def __init__(self, target: int):
        self.target, self.seen, self.done = target, 0, False
        self.note = ""           # what changed, when the diff of the lines does not say it (statements moved)

    def hit(self) -> bool:
        self.seen += 1
        if self.seen - 1 == self.target:
            self.done = True
            return True
        return False


def _applied(tree: ast.AST, transformer_for, target: int) -> tuple[ast.AST | None, str]:
    t = transformer_for(target)
    new = ast.fix_missing_locations(t.visit(copy.deepcopy(tree)))
    return (new if t.done else None), t.note


def _first_line(node: ast.AST) -> str:
    return " ".join(ast.unparse(node).splitlines()[0].split())[:80]


class SwapNames(_Once):
    def _swap(self, value: str):
        return SWAP.get(value) if value in SWAP and self.hit() else None

    def visit_Name(self, node):
        new = self._swap(node.id)
        return ast.copy_location(ast.Name(new, node.ctx), node) if new else node

    def visit_Attribute(self, node):
        self.generic_visit(node)
        new = self._swap(node.attr)
        if new:
            node.attr = new
        return node

    def visit_Constant(self, node):
        if isinstance(node.value, str):
            new = self._swap(node.value)
            if new:
                return ast.copy_location(ast.Constant(new), node)
        return node


class Keywords(_Once):
    """Each keyword argument of a call dropped (its default) or set to None; one whose value is a number or a name
    also set to 0 and to 1."""

    def visit_Call(self, node):
        self.generic_visit(node)
        for i, kw in enumerate(list(node.keywords)):
            if kw.arg is None:
                continue
            numeric = isinstance(kw.value, (ast.Name, ast.Attribute, ast.Subscript)) or (
                isinstance(kw.value, ast.Constant) and type(kw.value.value) in (int, float))
            for value in ("drop", None, 0, 1) if numeric else ("drop", None):
                if value != "drop" and isinstance(kw.value, ast.Constant) and kw.value.value == value \
                        and type(kw.value.value) is type(value):
                    continue
                if self.hit():
                    if value == "drop":
                        del node.keywords[i]
                    else:
                        node.keywords[i] = ast.keyword(kw.arg, ast.Constant(value))
                    return node
        return node


class ChangeSeed(_Once):
    """A seed changed: ``torch.manual_seed(s)``, ``seed=s`` -> ``s + 1`` (a seed a check never varies passes a
    function that ignores it)."""

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name in ("manual_seed", "seed") and node.args and self.hit():
            node.args[0] = ast.BinOp(node.args[0], ast.Add(), ast.Constant(1))
            return node
        for kw in node.keywords:
            if kw.arg and "seed" in kw.arg and self.hit():
                kw.value = ast.BinOp(kw.value, ast.Add(), ast.Constant(1))
                return node
        return node


class RemoveCall(_Once):
    """A statement that is only a call (``sampler.set_epoch(e)``, ``dist.barrier()``, ``fully_shard(block)``) removed."""

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Call) and self.hit():
            return ast.copy_location(ast.Pass(), node)
        return node


def _bodies(node):
    for name in ("body", "orelse", "finalbody"):
        body = getattr(node, name, None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            yield body


class SwapStatements(_Once):
    """Two neighbouring statements of a block in the other order (the optimizer made before ``fully_shard``)."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for body in _bodies(node):
            for i in range(len(body) - 1):
                a, b = body[i], body[i + 1]
                if isinstance(a, ast.Expr) and isinstance(a.value, ast.Constant):      # a docstring
                    continue
                if ast.dump(a) != ast.dump(b) and self.hit():
                    self.note = f"{_first_line(b)} <before> {_first_line(a)}"
                    body[i], body[i + 1] = b, a
                    return node
        return node


def _is_fresh(value: ast.AST) -> bool:
    """A value that starts an accumulator: a number, an empty list/dict/set, or a call without arguments."""
    if isinstance(value, ast.Constant) and isinstance(value.value, (int, float)):
        return True
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.Tuple)) and not getattr(value, "elts", getattr(value, "keys", [1])):
        return True
    return isinstance(value, ast.Call) and not value.args and not value.keywords


class HoistAccumulator(_Once):
    """``total = 0.0`` inside a loop moved to just before the loop: it then accumulates over every iteration."""

    def generic_visit(self, node):
        super().generic_visit(node)
        for body in _bodies(node):
            for i, loop in enumerate(list(body)):
                if not isinstance(loop, (ast.For, ast.While)):
                    continue
                for j, stmt in enumerate(loop.body):
                    if isinstance(stmt, ast.Assign) and _is_fresh(stmt.value) and self.hit():
                        self.note = f"{_first_line(stmt)} <out of> {_first_line(loop)}"
                        del loop.body[j]
                        if not loop.body:
                            loop.body.append(ast.Pass())
                        body.insert(i, stmt)
                        return node
        return node


class ReverseTuple(_Once):
    """A literal tuple or list of 2+ different items reversed (a mesh's shape or its dimension names)."""

    def visit_Tuple(self, node):
        return self._reverse(node)

    def visit_List(self, node):
        return self._reverse(node)

    def _reverse(self, node):
        self.generic_visit(node)
        if len(node.elts) >= 2 and len({ast.dump(e) for e in node.elts}) > 1 and isinstance(node.ctx, ast.Load) \
                and self.hit():
            node.elts = node.elts[::-1]
        return node


class AsDirectoryToPath(_Once):
    """``with checkpoint.as_directory() as d`` -> ``with nullcontext(checkpoint.path) as d``: a local folder's
    path where the checkpoint may live in cloud storage."""

    def visit_Call(self, node):
        self.generic_visit(node)
        if isinstance(node.func, ast.Attribute) and node.func.attr == "as_directory" and self.hit():
            return ast.parse(f"__import__('contextlib').nullcontext(({ast.unparse(node.func.value)}).path)",
                             mode="eval").body
        return node


class DriverDevice(_Once):
    """The workers' device replaced by the driver's: ``get_device()`` / ``torch.device(...)`` -> ``torch.device("cpu")``,
    ``.to(device)`` / ``.cuda()`` -> ``.to("cpu")``."""

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name in ("get_device", "current_device") or (name == "device" and ast.unparse(node) != "torch.device('cpu')"):
            if self.hit():
                return ast.parse("__import__('torch').device('cpu')", mode="eval").body
        return node


class FullStateDict(_Once):
    """A sharded state dict taken as a full one: ``options=StateDictOptions(full_state_dict=True)`` added to
    ``get_model_state_dict``, ``get_optimizer_state_dict``, ``get_state_dict``, ``set_*``."""
    CALLS = ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict", "set_model_state_dict",
             "set_optimizer_state_dict", "set_state_dict")

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name in self.CALLS and not any(k.arg == "options" for k in node.keywords) and self.hit():
            opts = ast.parse("__import__('torch.distributed.checkpoint.state_dict', fromlist=['x'])"
                             ".StateDictOptions(full_state_dict=True, broadcast_from_rank0="
                             f"{name.startswith('set')})", mode="eval").body
            node.keywords.append(ast.keyword("options", opts))
        return node


DOMAIN = {"swap-names": SwapNames, "keyword": Keywords, "change-seed": ChangeSeed, "remove-call": RemoveCall, "swap-statements": SwapStatements,
          "hoist-accumulator": HoistAccumulator, "reverse-tuple": ReverseTuple,
          "as-directory-to-path": AsDirectoryToPath, "driver-device": DriverDevice, "full-state-dict": FullStateDict}


def _changed(before: str, after: str) -> str:
    lines = [d for d in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
             if d[:1] in "+-" and not d.startswith(("+++", "---"))]
    return " | ".join(" ".join(d.split()) for d in lines)


BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def mutants(cell: str) -> list[Mutant]:
    """Every mutant of an answer cell that differs from it as code, each once: only the student's part is changed
    (between nbgrader's ``### BEGIN SOLUTION`` and ``### END SOLUTION``; the release gives the rest, the function's
    line and docstring), or the whole cell if it has no such part."""
    import textwrap

    lines = cell.splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if not begins or len(begins) != len(ends):
        return _mutants(cell)
    found, seen = [], {ast.dump(ast.parse(cell))}
    for b, e in zip(begins, ends):
        region = "\n".join(lines[b + 1:e])
        indent = lines[b][:len(lines[b]) - len(lines[b].lstrip())]
        for m in _mutants(textwrap.dedent(region)):
            body = textwrap.indent(m.source, indent, lambda _: True)
            _keep(found, seen, Mutant(m.operator, "\n".join([*lines[:b + 1], body, *lines[e:]]), m.diff))
    return found


def _keep(found: list[Mutant], seen: set[str], mutant: Mutant) -> None:
    """Add ``mutant`` to ``found`` unless it does not parse or is, as code, one already ``seen``."""
    try:
        dump = ast.dump(ast.parse(mutant.source))
    except SyntaxError:
        return
    if dump not in seen:
        seen.add(dump)
        found.append(mutant)


def _mutants(source: str) -> list[Mutant]:
    """Every mutant of ``source`` (code that parses on its own) that differs from it as code, each once."""
    from cosmic_ray.mutating import MutationVisitor
    from cosmic_ray.plugins import get_operator

    tree = ast.parse(source)
    seen = {ast.dump(tree)}
    found: list[Mutant] = []

    def keep(operator: str, code: str, before: str, note: str = ""):
        _keep(found, seen, Mutant(operator, code, note or _changed(before, code)))

    for name in COSMIC:
        op = get_operator(name)()
        for occurrence in range(500):
            code = MutationVisitor.mutate_code(source, op, occurrence)
            if code is None:
                break
            keep(name.removeprefix("core/"), code, source)
    plain = ast.unparse(tree)
    for name, transformer in DOMAIN.items():
        for occurrence in range(500):
            new, note = _applied(tree, transformer, occurrence)
            if new is None:
                break
            keep(name, ast.unparse(new), plain, note)
    return found


def defined_names(source: str) -> list[str]:
    """The names a cell binds at its top level (a mutant's cell must bind them again, or lose them)."""
    names = []
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
    return names


# ---------------------------------------------------------------------------------------------------- the runs

def exercises(module: str, nb) -> list[Exercise]:
    """The code exercises of a solutions notebook: each answer cell and its test cells judged here."""
    from autograder.checks import CODE, concepts

    checks = getattr(CODE.get(module), "CHECKS", {})
    found: list[Exercise] = []
    for i, cell in enumerate(nb.cells):
        meta = cell.metadata.get("nbgrader", {})
        gid = meta.get("grade_id")
        if cell.cell_type != "code":
            continue
        if meta.get("solution") and gid not in concepts.KEYS.get(module, {}):
            found.append(Exercise(gid, i, i))
        elif meta.get("grade") and gid in checks and found:
            found[-1].tests.append(gid)
            found[-1].last = i
    return [e for e in found if e.tests]


def equivalents() -> dict[tuple[str, str], dict[str, str]]:
    """(module, exercise) -> {mutant key: the reason it is equivalent}, from the reviewed files (one per module)."""
    out: dict[tuple[str, str], dict[str, str]] = {}
    for path in sorted(EQUIVALENT.glob("*.toml")):
        for row in tomllib.loads(path.read_text()).get("equivalent", []):
            out.setdefault((path.stem, row["exercise"]), {})[row["mutant"]] = row["reason"]
    return out


class Kernel:
    """The course's kernel running one solutions notebook in grading mode, cell by cell (nbclient): the module's
    first notebook, or ``notebook`` (one of ``autograder.paths.notebooks(module)``)."""

    def __init__(self, module: str, storage: Path, notebook: str | None = None):
        import nbformat
        from nbclient import NotebookClient

        from autograder.checks import asked

        self.module = module
        path = REPO / "solutions" / module / f"{notebook or notebooks(module)[0]}.ipynb"
        self.nb = nbformat.read(path, as_version=4)
        self.env = {**os.environ, "COURSE_GRADING": "1", "COURSE_SIZE": "smoke", "COURSE_STORAGE": str(storage),
                    "CUDA_VISIBLE_DEVICES": "", "COURSE_RECORD": "", "MPLBACKEND": "Agg",
                    "COURSE_ASKED": json.dumps(asked(module)), "PYTHONPATH": str(REPO)}
        self.client = NotebookClient(self.nb, timeout=CELL_LIMIT_S, kernel_name="ray-train-course",
                                     allow_errors=True, interrupt_on_timeout=True,
                                     resources={"metadata": {"path": str(path.parent)}})
        self.started = False

    def start(self) -> None:
        self.client.reset_execution_trackers()
        self.client.km = self.client.create_kernel_manager()
        self.client.start_new_kernel(env=self.env, cwd=str(REPO / "solutions" / self.module))
        self.client.start_new_kernel_client()
        self.started = True

    def stop(self) -> None:
        if self.started:
            try:
                self.client._cleanup_kernel()
            except Exception:  # noqa: BLE001
                pass
            self.started = False

    def alive(self) -> bool:
        from nbclient.util import run_sync

        return bool(self.client.kc) and run_sync(self.client.km.is_alive)()

    def run(self, index: int, source: str | None = None) -> tuple[dict, str | None]:
        """Execute cell ``index`` (with ``source`` instead of its own, if given); return (the cell, its error)."""
        original = self.nb.cells[index]
        cell = copy.deepcopy(original)
        if source is not None:
            cell.source = source
        cell.outputs = []
        try:
            self.client.execute_cell(cell, index)
        finally:           # nbclient stores the executed cell in its notebook: keep the reference's there
            self.nb.cells[index] = original
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        return cell, (f"{errors[-1]['ename']}: {errors[-1]['evalue']}"[:600] if errors else None)

    def code(self, source: str) -> str | None:
        """Run ``source`` as a cell of its own (housekeeping); return its error."""
        import nbformat

        cell, first = nbformat.v4.new_code_cell(source), self.nb.cells[0]
        try:
            self.client.execute_cell(cell, 0)
        finally:
            self.nb.cells[0] = first
        errors = [o for o in cell.outputs if o.get("output_type") == "error"]
        return f"{errors[-1]['ename']}: {errors[-1]['evalue']}" if errors else None


def _graded(kernel: Kernel, ex: Exercise, answer: str | None) -> tuple[str, str]:
    """Run the exercise's cells (``answer`` in place of the reference answer, if given) and judge its test cells
    here: ("killed" | "survived" | "timeout", what decided it)."""
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from autograder.checks import evidence, judge

    module = kernel.module
    if answer is not None:
        names = defined_names(kernel.nb.cells[ex.answer].source)
        if names:
            kernel.code("\n".join(f"globals().pop({n!r}, None)" for n in names))
    try:
        _, error = kernel.run(ex.answer, answer)
        if error and "KeyboardInterrupt" in error:
            return "timeout", f"the answer cell ran past {CELL_LIMIT_S} s"
        if error:
            return "killed", f"the answer cell raised {error}"
        failed = []
        for index in range(ex.answer + 1, ex.last + 1):
            cell, error = kernel.run(index)
            if error and "KeyboardInterrupt" in error:
                return "timeout", f"cell {index} ran past {CELL_LIMIT_S} s"
            gid = cell.metadata.get("nbgrader", {}).get("grade_id")
            if gid in ex.tests:
                passed, message = judge(module, gid, evidence(cell))
                if not passed:
                    failed.append(f"{gid}: {message}")
    except CellTimeoutError:
        return "timeout", f"a cell ran past {CELL_LIMIT_S} s"
    except DeadKernelError as e:
        return "killed", f"the kernel died ({e}): nbgrader scores the notebook 0"
    if failed:
        return "killed", " || ".join(m[:700] for m in failed)
    return "survived", "every graded cell of the exercise passed"


def run_module(module: str, only: str | None = None, out: Path = OUT, log=print) -> dict:
    """Every mutant of every code exercise of ``module`` (or only exercise ``only``), graded, notebook by notebook
    (only ``only``'s notebook); the results as a dict, also written to ``out/MODULE.json``."""
    import tempfile

    from autograder.checks import prepare

    start = time.perf_counter()
    prepare(module)
    storage = Path(tempfile.mkdtemp(prefix=f"mutants-{module}-"))
    result = {"module": module, "exercises": {}}
    try:
        names = [notebook_of(module, only)] if only else notebooks(module)
    except KeyError:                               # no such exercise: nothing to run
        names = []
    for notebook in names:
        _run_notebook(Kernel(module, storage, notebook), only, result, log)
    result["seconds"] = round(time.perf_counter() - start, 1)
    out.mkdir(parents=True, exist_ok=True)
    name = module if only is None else f"{module}.{only}"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    return result


def _run_notebook(kernel: Kernel, only: str | None, result: dict, log) -> None:
    """The mutants of the exercises of ``kernel``'s notebook (or only exercise ``only``), into ``result``."""
    from nbclient.exceptions import DeadKernelError

    module = kernel.module
    chosen = [e for e in exercises(module, kernel.nb) if only in (None, e.name)]
    if not chosen:
        return
    known = equivalents()
    kernel.start()
    done = 0                                       # the cells executed so far (by the reference)

    def replay(upto: int):
        nonlocal done
        for index in range(done, upto + 1):
            cell = kernel.nb.cells[index]
            if cell.cell_type == "code":
                kernel.run(index)
        done = upto + 1

    try:
        for ex in chosen:
            t0 = time.perf_counter()
            replay(ex.answer - 1)
            verdict, why = _graded(kernel, ex, None)
            done = ex.last + 1
            row = {"tests": ex.tests, "mutants": [], "reference": verdict}
            result["exercises"][ex.name] = row
            if verdict != "survived":
                row["error"] = f"the reference answer does not pass its checks here: {why}"
                log(f"[mutants] {module} {ex.name}: {row['error']}")
                continue
            found = mutants(kernel.nb.cells[ex.answer].source)
            log(f"[mutants] {module} {ex.name}: {len(found)} mutants")
            for n, m in enumerate(found, 1):
                m0 = time.perf_counter()
                try:
                    verdict, why = _graded(kernel, ex, m.source)
                except DeadKernelError as e:
                    verdict, why = "killed", f"the kernel died ({e})"
                if not kernel.alive():
                    kernel.stop()
                    kernel.start()
                    done = 0
                    replay(ex.answer - 1)
                if verdict == "survived" and m.key in known.get((module, ex.name), {}):
                    verdict, why = "equivalent", known[(module, ex.name)][m.key]
                row["mutants"].append({"operator": m.operator, "change": m.diff, "verdict": verdict,
                                       "message": why, "seconds": round(time.perf_counter() - m0, 1)})
                log(f"[mutants]   {n}/{len(found)} {verdict:10s} {m.key[:150]}")
            _graded(kernel, ex, kernel.nb.cells[ex.answer].source)      # the reference's state again
            row.update(summary(row["mutants"]), seconds=round(time.perf_counter() - t0, 1))
            log(f"[mutants] {module} {ex.name}: {row['killed']} killed, {row['equivalent']} equivalent, "
                f"{row['survived']} survived, {row['timeout']} timed out: score {row['score']}")
    finally:
        kernel.stop()


def summary(rows: list[dict]) -> dict:
    """Counts of each verdict, and the score: the share of the non-equivalent mutants killed."""
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("killed", "survived", "equivalent", "timeout")}
    live = len(rows) - counts["equivalent"]
    return {"generated": len(rows), **counts, "score": round(counts["killed"] / live, 3) if live else None}


def latest(module: str, out: Path = OUT) -> dict:
    """The last results of every exercise of ``module`` in ``out``: the module's run (``MODULE.json``), with each
    exercise run again alone since (``MODULE.EXERCISE.json``, newer) in its place."""
    runs = sorted(out.glob(f"{module}.*json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"no results of {module} in {out}: run python -m autograder.mutants {module}")
    merged: dict = {"module": module, "exercises": {}, "seconds": 0.0}
    for path in runs:                    # oldest first: a later run of an exercise replaces an earlier one
        if path.name != f"{module}.json" and not path.name.startswith(f"{module}."):
            continue
        result = json.loads(path.read_text())
        merged["exercises"].update(result["exercises"])
    merged["seconds"] = round(sum(row.get("seconds") or 0 for row in merged["exercises"].values()), 1)
    order = [e.name for name in notebooks(module) for e in exercises(module, __import__("nbformat").read(
        REPO / "solutions" / module / f"{name}.ipynb", as_version=4))]
    merged["exercises"] = {name: merged["exercises"][name] for name in order if name in merged["exercises"]}
    return merged


def collect(result: dict) -> dict:
    """A module's results (``run_module``'s) with the reviewed file's equivalents applied as it reads now: per
    exercise, the counts, the score, the equivalents with their reasons and what survived or timed out."""
    known = equivalents()
    out = {"seconds": result.get("seconds"), "exercises": {}}
    for name, row in result["exercises"].items():
        if row.get("error"):
            out["exercises"][name] = {"error": row["error"], "generated": 0, "score": None}
            continue
        reasons = known.get((result["module"], name), {})
        rows = []
        for m in row["mutants"]:
            key = f"{m['operator']}: {m['change']}"
            if m["verdict"] in ("survived", "equivalent"):
                m = {**m, "verdict": "equivalent" if key in reasons else "survived",
                     "message": reasons.get(key, m["message"])}
            rows.append({**m, "key": key})
        out["exercises"][name] = {
            **summary(rows), "seconds": row.get("seconds"),
            "equivalents": [{"mutant": m["key"], "reason": m["message"]} for m in rows if m["verdict"] == "equivalent"],
            "left": [{"mutant": m["key"], "verdict": m["verdict"]} for m in rows
                     if m["verdict"] in ("survived", "timeout")]}
    return out


def main(argv: list[str] | None = None) -> int:
    from autograder.checks import FILES

    p = argparse.ArgumentParser(description="Mutation testing of the grader's checks (see the module's docstring).")
    p.add_argument("modules", nargs="*", help=f"modules (default: all of {', '.join(FILES)})")
    p.add_argument("--exercise", default=None, help="only this exercise (its answer cell's grade_id)")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--list", action="store_true", help="only list the mutants, run nothing")
    args = p.parse_args(argv)
    modules = args.modules or list(FILES)
    unknown = set(modules) - set(FILES)
    if unknown:
        p.error(f"unknown module(s) {', '.join(sorted(unknown))}; choose from {', '.join(FILES)}")
    if args.list:
        import nbformat

        for module in modules:
            for name in notebooks(module):
                nb = nbformat.read(REPO / "solutions" / module / f"{name}.ipynb", as_version=4)
                for ex in exercises(module, nb):
                    if args.exercise in (None, ex.name):
                        found = mutants(nb.cells[ex.answer].source)
                        print(f"{module} {ex.name}: {len(found)} mutants, tests {', '.join(ex.tests)}")
                        for m in found:
                            print(f"    {m.key[:200]}")
        return 0
    bad = 0
    for module in modules:
        result = run_module(module, args.exercise, args.out)
        bad += sum(1 for row in result["exercises"].values() if row.get("error"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
