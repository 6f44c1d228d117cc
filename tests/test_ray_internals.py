"""coursekit.ray_internals: every private piece of Ray the course uses, in one place, checked against one Ray.

After a Ray upgrade this file fails first: it names each private class, function, module, method or attribute
the course imports, overrides, calls or sets that the new Ray moved. Nothing else in the repository reaches
into Ray's private modules (checked here too), so that list is complete.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from coursekit import ray_internals
from coursekit.paths import REPO

# Python files that may reach into Ray's private modules without coursekit.ray_internals: none but the module
# itself. A use found in a notebook is listed here until the notebook's author moves it (tests may not edit
# notebooks), with what it uses.
KNOWN_NOTEBOOK_USES: dict[str, set[str]] = {}      # notebook -> private Ray it may import (none now)
FOLDERS = ("coursekit", "autograder", "deploy", "bench", "solutions", "tests")


def test_every_private_piece_of_ray_the_course_uses_is_there():
    gone = ray_internals.missing()
    assert not gone, (f"Ray {ray_internals.installed_version()} lacks what the course uses (coursekit/ray_internals.py "
                      "names who uses each):\n" + "\n".join(gone))


def test_every_ray_train_setting_the_course_sets_is_still_read_and_handed_on():
    from coursekit.raysetup import RAY_ENV

    constants = ray_internals.train_constants
    assert {k for k in RAY_ENV if k.startswith("RAY_TRAIN_")} == set(ray_internals.ENV_SETTINGS)
    for env_var, attribute in ray_internals.ENV_SETTINGS.items():
        assert getattr(constants, attribute) == env_var, f"Ray Train no longer reads {env_var}"
        assert env_var in constants.ENV_VARS_TO_PROPAGATE, f"fit() no longer hands {env_var} to its controller"
    from ray.tune.constants import TUNE_ENV_VARS

    tune_settings = {k for k in RAY_ENV if k.startswith("TUNE_")}
    assert tune_settings and tune_settings <= TUNE_ENV_VARS, f"Ray Tune no longer reads {tune_settings - TUNE_ENV_VARS}"


def test_what_moved_is_named_with_who_uses_it(monkeypatch):
    monkeypatch.setitem(ray_internals.SYMBOLS, "Gone", "ray.train.v2._internal.nowhere:Gone")
    monkeypatch.setattr(ray_internals, "MEMBERS", [("StorageContext", "_renamed_in_a_later_ray", "used by X")])
    monkeypatch.setattr(ray_internals, "INSTANCE_ATTRIBUTES",
                        [("ASHAScheduler", {}, "_brackets.0._not_there", "read by Y")])
    gone = ray_internals.missing()
    assert len(gone) == 3, gone
    assert gone[0].startswith("Gone = ray.train.v2._internal.nowhere:Gone: ModuleNotFoundError")
    assert gone[1].startswith("StorageContext._renamed_in_a_later_ray (used by X): AttributeError")
    assert gone[2].startswith("ASHAScheduler(...)._brackets.0._not_there (read by Y): AttributeError")


def test_the_version_written_for_is_the_one_requirements_txt_pins():
    pins = (REPO / "requirements.txt").read_text()
    pinned = re.search(r"^ray\[[^\]]*\]==(\S+)", pins, re.M)
    assert pinned, "requirements.txt pins no ray[...]"
    assert pinned.group(1) == ray_internals.RAY_VERSION, (
        f"requirements.txt pins Ray {pinned.group(1)}, coursekit/ray_internals.py was written for "
        f"{ray_internals.RAY_VERSION}: run this file against the new Ray, then set RAY_VERSION")


def test_another_ray_fails_at_import_saying_what_to_do():
    """The guard runs when the module is imported (no Ray import needed to fail): here with Ray's version faked."""
    code = ("import importlib.metadata as m\n"
            "real = m.version\n"
            "m.version = lambda name: '2.61.0' if name == 'ray' else real(name)\n"
            "import coursekit.ray_internals\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "RayVersionError" in proc.stderr, proc.stderr[-2000:]
    message = proc.stderr.strip().splitlines()[-1]
    for what in ("Ray 2.60.0", "Ray 2.61.0", "pip install -r requirements.txt", "tests/test_ray_internals.py",
                 "coursekit/ray_internals.py"):
        assert what in message, f"{what!r} not in: {message}"


def test_the_version_check_accepts_only_the_version_written_for():
    assert ray_internals.version_problem(ray_internals.RAY_VERSION) is None
    assert ray_internals.version_problem("2.60.1")
    assert "not installed" in ray_internals.version_problem("not installed")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'NotAThing'"):
        ray_internals.NotAThing  # noqa: B018


def _private_uses(tree: ast.AST) -> set[str]:
    """Ray modules and attributes named in code (not in strings or comments) that are private: a path with a
    component starting with "_", a name imported with a leading "_", or a module coursekit.ray_internals lists."""
    listed = {spec.partition(":")[0] for spec in ray_internals.SYMBOLS.values()
              if "._" in spec.partition(":")[0] or ":" not in spec}
    private = {m for m in listed if m.split(".")[0] == "ray" and m not in ("ray.train", "ray.train.torch")}

    def bad(path: str) -> bool:
        parts = path.split(".")
        return parts[0] == "ray" and (any(p.startswith("_") and not p.endswith("__") for p in parts[1:]) or
                                      any(path == m or path.startswith(m + ".") for m in private))

    found = set()
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}   # a.b of a.b.c: seen whole
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if bad(a.name)}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" for a in node.names if bad(f"{node.module}.{a.name}")}
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "ray":
                path = ".".join(["ray", *reversed(chain)])
                if bad(path):
                    found.add(path)
    return found


def _code_cells(path) -> str:
    cells = json.loads(path.read_text())["cells"]
    lines = []
    for c in cells:
        if c["cell_type"] == "code":
            lines += [ln for ln in "".join(c["source"]).splitlines() if not ln.lstrip().startswith(("%", "!"))]
            lines.append("")
    return "\n".join(lines)


def test_nothing_else_reaches_into_rays_private_modules():
    uses = {}
    for folder in FOLDERS:
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel == "coursekit/ray_internals.py" or "/.ipynb_checkpoints/" in rel:
                continue
            found = _private_uses(ast.parse(path.read_text(), rel))
            if found:
                uses[rel] = sorted(found)
        for path in sorted((REPO / folder).rglob("*.ipynb")) if folder == "solutions" else ():
            rel = str(path.relative_to(REPO))
            found = _private_uses(ast.parse(_code_cells(path), rel)) - KNOWN_NOTEBOOK_USES.get(rel, set())
            if found:
                uses[rel] = sorted(found)
    assert not uses, ("private Ray used outside coursekit/ray_internals.py (import it from there: "
                      f"`from coursekit.ray_internals import ...`, adding it to SYMBOLS): {uses}")


def test_the_scan_finds_private_uses():
    code = ("import ray._private.worker\nfrom ray.train.v2._internal.execution import storage\n"
            "from ray.train import _private_thing\nfrom ray.experimental import internal_kv\n"
            "x = ray._private.services.wait_for_node\ny = 'ray._private.in_a_string'\n")
    assert _private_uses(ast.parse(code)) == {
        "ray._private.worker", "ray.train.v2._internal.execution.storage",
        "ray.train._private_thing", "ray.experimental.internal_kv", "ray._private.services.wait_for_node"}
