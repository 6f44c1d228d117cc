"""The two install paths (pip via make, conda via environment.yml) agree, and the pins are the ones we test."""

import subprocess
import sys

import yaml  # PyYAML comes with jupyter/ray

from conftest import REPO, read_pins

PINNED = {
    "torch": "2.14.1", "torchvision": "0.29.1", "ray": "2.60.0", "deepspeed": "0.19.8",
    "nbgrader": "0.9.6", "papermill": "2.7.0",
}


def requirements() -> dict[str, str]:
    return read_pins(REPO / "requirements.txt")


def test_requirements_are_exact_pins_with_the_course_versions():
    pins = requirements()
    for name, version in PINNED.items():
        assert pins.get(name) == version, f"{name} must be pinned to {version}"
    assert pins["jupyterlab"].startswith("4.6.") and pins["ipywidgets"].startswith("8.1.")
    extras = (REPO / "requirements.txt").read_text().split("ray[")[1].split("]")[0].split(",")
    # default: the dashboard, whose State API Ray Train's placement-group cleaner needs (module 04)
    assert {"default", "train", "data", "tune"} <= set(extras)


def test_environment_yml_agrees_with_requirements():
    env = yaml.safe_load((REPO / "environment.yml").read_text())
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_section = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    # Either it installs requirements.txt itself, or it lists exactly the same pins.
    if "-r requirements.txt" not in pip_section:
        listed = {}
        for item in pip_section:
            name, _, version = item.partition("==")
            listed[name.split("[")[0].lower()] = version
        assert listed == requirements()


def test_installed_versions_match_the_pins():
    from importlib.metadata import version

    for name, pinned in requirements().items():
        assert version(name) == pinned, f"{name} {version(name)} is installed, {pinned} is pinned"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_command():
    readme = (REPO / "README.md").read_text()
    head = readme[:1500]
    assert "make lab" in head and "make test" in head
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_importing_ray_does_not_compile_jsonschemas_uri_grammar():
    """make (and binder/postBuild) remove rfc3987-syntax: imported by jsonschema when present, it compiles a
    grammar that costs every process importing Ray ~1.5 s here (Ray Train's workers, controller, helper actors)."""
    code = "import sys, ray; print('rfc3987_syntax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False", "rfc3987-syntax is installed: `pip uninstall rfc3987-syntax` (see the Makefile)"
