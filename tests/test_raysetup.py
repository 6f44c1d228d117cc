"""Ray start-up: the noise filter, and coursekit reaching the workers."""
import dataclasses
import subprocess

import pytest

from coursekit.raysetup import _is_noise
from helpers import PY


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


def test_a_local_ray_prestarts_nothing_and_ray_train_polls_its_workers_often(monkeypatch):
    """What init_ray hands Ray for a fit's fixed cost: no idle prestarted processes (nothing of the course's
    can use them: its job has a runtime_env), and a controller that polls every 0.1 s (a fit ends at the
    first poll after the train function returns), set in the driver's environment, which Ray Train's fit()
    passes on to its controller and workers."""
    import os

    import ray

    from coursekit import raysetup
    from coursekit.runtime import detect

    env = {k: v for k, v in os.environ.items() if k not in raysetup.RAY_ENV and k != "RAY_ADDRESS"}
    monkeypatch.setattr(os, "environ", env)
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs) or "context")
    assert raysetup.init_ray(detect(), quiet=False) == "context"
    assert seen["_system_config"]["enable_worker_prestart"] is False
    assert seen["_system_config"]["prestart_worker_first_driver"] is False
    assert seen["_system_config"]["worker_maximum_startup_concurrency"] >= 6   # a fit's processes start together
    assert env["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.1"
    assert seen["runtime_env"]["env_vars"]["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.1"


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


@pytest.mark.slow
def test_joining_an_existing_cluster_ships_coursekit_to_its_workers(tmp_path):
    """The Anyscale path: RAY_ADDRESS points at a running cluster; coursekit travels as a py_module."""
    import os
    import signal
    import time
    from pathlib import Path

    from coursekit.distributed import free_port

    import shutil
    import tempfile

    port = free_port()
    ray_cli = str(Path(PY).parent / "ray")
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's unix sockets live under it (107-char limit)
    # On SIGTERM a head node first drains (for Ray Serve) and waits the full 30 s: none here to drain.
    head_env = {**os.environ, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    head = subprocess.Popen([ray_cli, "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                             "--include-dashboard=false", f"--temp-dir={temp_dir}"], env=head_env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        script = tmp_path / "join.py"
        script.write_text(
            "import ray\n"
            "from coursekit.raysetup import init_ray\n"
            "from coursekit.runtime import detect\n"
            "rt = detect()\n"
            "assert rt.ray_address, rt\n"
            "init_ray(rt)\n"
            "@ray.remote\n"
            "def where():\n"
            "    import coursekit\n"
            "    return coursekit.__file__\n"
            "print('WORKER_COURSEKIT', ray.get(where.remote()))\n"
            "print('CLUSTER_CPUS', ray.cluster_resources()['CPU'])\n")
        env = {**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}
        env.pop("RAY_AUTH_MODE", None)  # as a student's terminal would be: init_ray finds the token
        deadline = time.time() + 150
        while True:
            proc = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=180, env=env,
                                  cwd=tmp_path)  # not the repo: coursekit must arrive as a py_module
            if proc.returncode == 0 or time.time() > deadline:
                break
            time.sleep(5)  # the head may still be starting
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-2500:]
        worker_path = proc.stdout.split("WORKER_COURSEKIT ")[1].splitlines()[0]
        assert "_ray_pkg_" in worker_path or "runtime_resources" in worker_path, worker_path
        assert "CLUSTER_CPUS 1.0" in proc.stdout  # we joined the 1-CPU cluster, not a new local one
    finally:
        try:
            os.killpg(head.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_lean_start_caps_the_store_starts_no_idle_workers_and_keeps_a_callers_system_config(monkeypatch):
    import ray

    import coursekit.raysetup as raysetup
    from coursekit.runtime import detect

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw) or "ctx")
    monkeypatch.setattr(raysetup, "_install_log_filter", lambda: True)
    binder = detect({"COURSE_PLATFORM": "binder"})
    assert raysetup.init_ray(binder, _system_config={"idle_worker_killing_time_threshold_ms": 600_000}) == "ctx"
    assert seen["include_dashboard"] is False and seen["object_store_memory"] == 256 * 2**20
    assert seen["_system_config"] == {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                      "worker_maximum_startup_concurrency": 8,
                                      "idle_worker_killing_time_threshold_ms": 600_000}
    # a big local machine keeps Ray's object store; it starts a fit's processes together, and no idle ones either
    # (the course's job has a runtime_env: nothing of it could run in them)
    seen.clear()
    big = dataclasses.replace(detect({"COURSE_PLATFORM": "local"}), memory_gib=64.0)
    raysetup.init_ray(big)
    assert seen["_system_config"] == {"worker_maximum_startup_concurrency": 8, "enable_worker_prestart": False,
                                      "prestart_worker_first_driver": False} and "object_store_memory" not in seen


def test_a_fits_processes_start_together_and_a_caller_can_override_it(monkeypatch):
    """Ray Train starts 6 processes per fit(); the raylet's default (num_cpus at once) queued the 2 workers
    behind the helper actors. A caller's own value wins; joining a cluster sets no system config."""
    import ray

    import coursekit.raysetup as raysetup
    from coursekit.runtime import detect

    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw) or "ctx")
    monkeypatch.setattr(raysetup, "_install_log_filter", lambda: True)
    local = dataclasses.replace(detect({"COURSE_PLATFORM": "local"}), memory_gib=64.0)
    raysetup.init_ray(local, _system_config={"worker_maximum_startup_concurrency": 3})
    assert seen["_system_config"] == {**raysetup.START_SYSTEM_CONFIG, "worker_maximum_startup_concurrency": 3}
    seen.clear()
    raysetup.init_ray(dataclasses.replace(local, ray_address="ray://head:10001"))
    assert "_system_config" not in seen and seen["address"] == "ray://head:10001"
