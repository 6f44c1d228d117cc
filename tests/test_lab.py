"""`make lab` serves course/ with the course kernel and the widgets extension (headless, no browser)."""
import json
import os
import subprocess
import urllib.request

import pytest

from coursekit.distributed import free_port
from helpers import REPO, stop_process_group, wait_for_server

# `make lab` checks the venv's stamps (and reinstalls the course set when requirements.txt or pyproject.toml is newer),
# then starts a Jupyter server: not the development loop
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def lab():
    port, token = free_port(), "course-test-token"
    env = {**os.environ, "LAB_ARGS": f"--no-browser --port={port} --IdentityProvider.token={token} "
                                     "--ServerApp.open_browser=False"}
    proc = subprocess.Popen(["make", "lab"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def get(path):
        req = urllib.request.Request(base + path, headers={"Authorization": f"token {token}"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.read().decode()

    wait_for_server(get, proc, "JupyterLab", _stop)
    yield get
    _stop(proc)


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
