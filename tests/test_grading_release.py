"""`make release` (the student-only copy) and nbgrader's formgrader on a grading course root."""
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import nbformat
import pytest

from autograder.grade import prepare
from autograder.release import REPO, modules
from autograder.student_release import build, leaks, main as release_main
from coursekit.distributed import free_port
from conftest import wait_for_server


def test_student_release_has_the_course_and_no_answers(tmp_path):
    out = tmp_path / "student-release"
    assert release_main(["--into", str(out)]) == 0
    for part in ("README.md", "requirements.txt", "pyproject.toml", "binder/postBuild", "coursekit/runtime.py"):
        assert (out / part).exists(), part
    for m in modules():
        assert (out / "course" / m / f"{m}.ipynb").read_bytes() == (REPO / "course" / m / f"{m}.ipynb").read_bytes()
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

    wait_for_server(get, proc, "jupyter server", lambda p: os.killpg(p.pid, signal.SIGTERM))
    yield get
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


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
    index, gid, lines = next(a for a in answers(module) if a[0] >= 0 and a[2])
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
    assert any("shown above" in p and gid in p for p in set(answer_leaks(release, [module])) - before)
