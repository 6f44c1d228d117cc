"""Ray start-up: the noise filter, and coursekit reaching the workers."""
import subprocess

import pytest

from coursekit.raysetup import _is_noise
from conftest import PY


@pytest.mark.parametrize("actor, line, noise", [
    ("PlacementGroupCleaner", "Failed to query Ray Train Controller actor state.", True),
    ("TrainController", "Requesting resources: {'CPU': 1} * 2", True),
    ("RayTrainWorker", "Reporting training result 1: TrainingReport(...)", True),
    ("RayTrainWorker", "epoch 0 loss 1.23", False),                    # the student's own print
    ("RayTrainWorker", "Traceback (most recent call last):", False),   # errors always show
    ("TrainController", "Worker group failed: RayActorError ...", False),
])
def test_noise_filter_keeps_the_students_output_and_errors(actor, line, noise):
    assert _is_noise(actor, line) is noise


@pytest.mark.slow
def test_local_ray_reaches_coursekit_on_workers_and_prints_only_user_output(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "import os, ray\n"
        "from coursekit.raysetup import init_ray\n"
        "os.chdir('/')\n"  # not the repo: workers must find coursekit by installation, not by cwd
        "init_ray()\n"
        "@ray.remote\n"
        "def where():\n"
        "    import coursekit, coursekit.runtime\n"
        "    print('hello from a worker')\n"
        "    return coursekit.__file__, coursekit.runtime.detect().size\n"
        "print(ray.get(where.remote()))\n")
    proc = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "coursekit/__init__.py" in proc.stdout and "'smoke'" in proc.stdout  # COURSE_* reached the worker
    assert "hello from a worker" in proc.stdout
