"""`make release` (the student-only copy) and nbgrader's formgrader on a grading course root."""
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
import pytest

from autograder.grade import prepare
from autograder.paths import notebooks
from autograder.release import REPO, modules
from autograder.student_release import build, leaks, main as release_main
from coursekit.distributed import free_port
from helpers import stop_process_group, wait_for_server


def test_student_release_has_the_course_and_no_answers(tmp_path):
    out = tmp_path / "student-release"
    assert release_main(["--into", str(out)]) == 0
    for part in ("README.md", "requirements.txt", "pyproject.toml", "binder/postBuild", "coursekit/runtime.py"):
        assert (out / part).exists(), part
    for m in modules():
        for name in notebooks(m):
            assert (out / "course" / m / f"{name}.ipynb").read_bytes() == \
                (REPO / "course" / m / f"{name}.ipynb").read_bytes()
    assert not leaks(out)
    assert not any(p.name in ("solutions", "autograder", "tests") for p in out.rglob("*"))


def test_the_release_check_catches_a_leak(tmp_path):
    out = build(tmp_path / "student-release")
    m = modules()[0]
    nb = out / "course" / m / f"{m}.ipynb"
    nb.write_text(nb.read_text().replace("YOUR CODE HERE", "### BEGIN SOLUTION"))
    assert any("marker" in p for p in leaks(out))
    source = (REPO / "solutions" / m / f"{m}.ipynb").read_text()
    nb.write_text(source.replace("### BEGIN SOLUTION", "#").replace("### END SOLUTION", "#")
                  .replace("### BEGIN HIDDEN TESTS", "#").replace("### END HIDDEN TESTS", "#"))
    assert any("solutions/hidden" in p for p in leaks(out, [m]))


@pytest.fixture(scope="module")
def formgrader(tmp_path_factory):
    out = tmp_path_factory.mktemp("grading")
    prepare(out, [modules()[0]])                       # a real course root with its gradebook
    root = out / "nbgrader"
    port, token = free_port(), "formgrader-test-token"
    args = [str(Path(sys.executable).parent / "jupyter"), "server", "--no-browser", f"--port={port}",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}"]
    if os.getuid() == 0:
        args.append("--allow-root")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.Popen(args, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)

    def get(path):
        req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, r.read().decode()

    wait_for_server(get, proc, "jupyter server", stop_process_group)
    yield get
    stop_process_group(proc)


@pytest.mark.slow
def test_formgrader_serves_the_grading_course(formgrader):
    status, page = formgrader("/formgrader")
    assert status == 200 and "formgrader" in page.lower()
    status, body = formgrader("/formgrader/api/assignments")
    assert status == 200
    assert modules()[0] in {a["name"] for a in json.loads(body)}


def test_scripts_are_released_with_their_solution_regions_stubbed():
    from autograder.release import strip_script

    text = ("def f(x):\n    '''doc'''\n    ### BEGIN SOLUTION\n    return x + 1\n    ### END SOLUTION\n\n"
            "print(f(1))\n")
    out = strip_script(text)
    assert "return x + 1" not in out and "SOLUTION" not in out
    assert "    raise NotImplementedError()\n" in out and out.endswith("print(f(1))\n")
    with pytest.raises(ValueError):
        strip_script("### BEGIN SOLUTION\nx = 1\n")


def test_answer_lines_in_a_released_script_or_above_the_exercise_are_leaks(tmp_path):
    from autograder.release import REPO, modules
    from autograder.student_release import answer_leaks, answers

    module = modules()[1]
    index, gid, lines, *_ = next(a for a in answers(module) if a[0] >= 0 and a[2])
    release = tmp_path / "course"
    shutil.copytree(REPO / "course" / module, release / module)
    before = set(answer_leaks(release, [module]))
    line = sorted(lines)[0]
    (release / module / "extra.py").write_text(f"x = 1\n{line}\n")
    assert any("extra.py" in p and gid in p for p in set(answer_leaks(release, [module])) - before)
    (release / module / "extra.py").unlink()
    nb = nbformat.read(release / module / f"{module}.ipynb", as_version=4)
    nb.cells[0].source += f"\n\n    {line}\n"
    nbformat.write(nb, release / module / f"{module}.ipynb")
    assert any("shown outside its cell" in p and gid in p for p in set(answer_leaks(release, [module])) - before)


def _renamed(code: str) -> str:
    """``code`` with every variable, argument and function renamed and reformatted: what a line check misses."""
    import ast

    class Rename(ast.NodeTransformer):
        def visit_Name(self, node):
            node.id = f"{node.id}_x"
            return node

        def visit_arg(self, node):
            node.arg = f"{node.arg}_x"
            return node

        def visit_FunctionDef(self, node):
            self.generic_visit(node)
            node.name = f"{node.name}_x"
            return node

        def visit_Expr(self, node):    # the docstring goes too
            return None if isinstance(node.value, ast.Constant) else self.generic_visit(node)

    return ast.unparse(Rename().visit(ast.parse(code)))


@pytest.mark.slow
def test_an_answer_with_its_names_changed_is_still_a_leak_and_each_module_sees_only_earlier_answers(tmp_path):
    """The check compares code by its shape (names and literals abstracted), not by its lines; and a module's
    folder may hold earlier modules' answers (they are released after those deadlines), never its own or a later
    module's; coursekit and the other shared files hold none."""
    from autograder.samples import solution_answers
    from autograder.student_release import answer_leaks

    first, second = modules()[0], modules()[1]
    gid, code = max(solution_answers(first).items(), key=lambda kv: len(kv[1]))   # its longest answer
    disguised = _renamed(code)
    assert not {ln.strip() for ln in disguised.splitlines() if len(ln.strip()) > 20} & {
        ln.strip() for ln in code.splitlines()}, "the disguise keeps a line that the line check would find"
    out = build(tmp_path / "student-release")
    before = set(answer_leaks(out))

    def new_leaks():
        return [p for p in set(answer_leaks(out)) - before if gid in p]

    for where in (out / "course" / first / "helpers.py", out / "coursekit" / "extra.py"):
        where.write_text(disguised)
        assert new_leaks(), f"{first}'s {gid} renamed, in {where.relative_to(out)}, was not found"
        where.unlink()
    (out / "course" / second / "earlier.py").write_text(disguised)     # released after the first's deadline
    assert not new_leaks(), new_leaks()
    (out / "course" / second / "earlier.py").unlink()
    # a staged release: the first module only, checked against every module's answers
    staged = tmp_path / "staged"
    assert release_main(["--into", str(staged), "--through", first]) == 0
    assert sorted(p.name for p in (staged / "course").iterdir()) == [first]


def test_nbgrader_reads_the_course_config_from_the_repository_root():
    """nbgrader's own commands (generate_assignment, db, formgrader) run from the repository root load
    ./nbgrader_config.py, which loads autograder/nbgrader_config.py: this course's root and folders."""
    code = ("from nbgrader.apps.baseapp import NbGrader; from nbgrader.coursedir import CourseDirectory\n"
            "app = NbGrader(); app.load_config_file(); cd = CourseDirectory(config=app.config)\n"
            "print(cd.root, cd.source_directory, cd.release_directory, app.config.Execute.timeout, sep='|')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"{REPO}|solutions|course|600", proc.stdout + proc.stderr


def test_nbgrader_generate_assignment_from_the_root_stubs_the_scripts_as_make_assignments_does(tmp_path):
    """The real CLI in a copy of the repository's root (a few seconds): `nbgrader generate_assignment
    02_ray_train` writes course/02_ray_train with its script's solution regions stubbed (the root config's
    post-convert hook), and the gradebook under build/."""
    from autograder.release import strip_script

    module = "02_ray_train"
    shutil.copy(REPO / "nbgrader_config.py", tmp_path)
    shutil.copytree(REPO / "autograder", tmp_path / "autograder", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "solutions" / module, tmp_path / "solutions" / module,
                    ignore=shutil.ignore_patterns("__pycache__", ".ipynb_checkpoints"))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "nbgrader"), "generate_assignment", module],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = tmp_path / "course" / module
    assert (out / f"{module}.ipynb").exists() and (tmp_path / "build" / "release-gradebook.db").exists()
    scripts = sorted((tmp_path / "solutions" / module).glob("*.py"))
    assert any("### BEGIN SOLUTION" in s.read_text() for s in scripts)
    for script in scripts:
        assert (out / script.name).read_text() == strip_script(script.read_text()), script.name
    assert not leaks(tmp_path / "course", [module]), leaks(tmp_path / "course", [module])
