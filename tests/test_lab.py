"""`make lab` serves course/ with the course kernel and the widgets extension, as students see it (nbgrader's
Validate button and Assignment List, no instructor tools, no news prompt); `make lab-instructor` serves the
repository root with nbgrader's Formgrader. Headless, no browser (tests/test_browser.py drives one)."""
import json
import os
import re
import subprocess
import urllib.error
import urllib.request

import pytest

from coursekit.distributed import free_port
from helpers import REPO, stop_process_group, wait_for_server

# `make lab` checks the venv's stamps (and reinstalls the course set when requirements.txt or pyproject.toml is newer),
# then starts a Jupyter server: not the development loop
pytestmark = pytest.mark.slow


def _serve(target: str):
    port, token = free_port(), "course-test-token"
    env = {**os.environ, "LAB_ARGS": f"--no-browser --port={port} --IdentityProvider.token={token} "
                                     "--ServerApp.open_browser=False"}
    proc = subprocess.Popen(["make", target], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def get(path):
        req = urllib.request.Request(base + path, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    wait_for_server(get, proc, f"JupyterLab (make {target})", _stop)
    return proc, get


@pytest.fixture(scope="module")
def lab():
    proc, get = _serve("lab")
    yield get
    _stop(proc)


@pytest.fixture(scope="module")
def instructor_lab():
    proc, get = _serve("lab-instructor")
    yield get
    _stop(proc)


def _status(get, path: str) -> int:
    try:
        get(path)
        return 200
    except urllib.error.HTTPError as e:
        return e.code


def _page_config(get) -> dict:
    """The page configuration JupyterLab's front end starts from (what its plugins and news prompt read)."""
    page = get("/lab")
    return json.loads(re.search(r'<script id="jupyter-config-data" type="application/json">(.*?)</script>',
                                page, re.S).group(1))


INSTRUCTOR_PLUGINS = {"@jupyter/nbgrader:formgrader", "@jupyter/nbgrader:create-assignment",
                      "@jupyter/nbgrader:course-list"}


def test_students_get_validate_and_the_assignment_list_and_no_instructor_tools(lab):
    config = _page_config(lab)
    disabled = set(config["disabledExtensions"])
    assert INSTRUCTOR_PLUGINS <= disabled
    assert not {"@jupyter/nbgrader:validate-assignment", "@jupyter/nbgrader:assignment-list"} & disabled
    assert config["news"] == {"disabled": True}                      # no "receive official news?" prompt
    assert _status(lab, "/formgrader") == 404 and _status(lab, "/formgraders") == 404
    import nbgrader

    # the Assignment List's server extension answers; the Validate button's handler exists (it takes POSTs only)
    assert json.loads(lab(f"/nbgrader_version?version={nbgrader.__version__}")) == {"success": True}
    assert _status(lab, "/assignments/validate") == 405


def test_instructors_get_formgrader_on_the_repository_root(instructor_lab):
    config = _page_config(instructor_lab)
    assert not INSTRUCTOR_PLUGINS & set(config["disabledExtensions"])
    names = {item["name"] for item in json.loads(instructor_lab("/api/contents"))["content"]}
    assert {"course", "solutions", "nbgrader_config.py"} <= names     # formgrader's course root
    assert _status(instructor_lab, "/formgrader/manage_assignments") == 200


def _stop(proc):
    stop_process_group(proc)


def test_lab_serves_the_course_folder(lab):
    root = json.loads(lab("/api/contents"))
    names = {item["name"] for item in root["content"]}
    assert {"01_ddp_pytorch", "02_ray_train"} <= names
    module = json.loads(lab("/api/contents/02_ray_train"))
    assert "02_ray_train.ipynb" in {item["name"] for item in module["content"]}


def test_the_course_kernel_is_registered(lab):
    specs = json.loads(lab("/api/kernelspecs"))["kernelspecs"]
    assert specs["ray-train-course"]["spec"]["display_name"] == "Python (Ray Train course)"


def test_widgets_extension_is_installed(lab):
    page = lab("/lab")
    assert "@jupyter-widgets/jupyterlab-manager" in page
