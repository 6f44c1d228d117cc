"""Runtime detection: platform, device/backend, sizes and storage come from one place."""
import pytest

import os

from coursekit.paths import REPO
from coursekit.runtime import REPO_ROOT, SIZES, Settings, detect, settings


def test_this_machine_is_a_cpu_box_with_gloo():
    rt = detect({"COURSE_SIZE": "smoke"})
    assert rt.device == "cpu" and rt.backend == "gloo" and not rt.use_gpu
    assert rt.default_workers == 2
    assert rt.sizes == SIZES["smoke"]


@pytest.mark.parametrize("env, platform", [
    ({}, "local"),
    ({"CI": "true"}, "ci"),
    ({"COURSE_GRADING": "1"}, "ci"),
    ({"BINDER_LAUNCH_HOST": "https://mybinder.org/"}, "binder"),
    ({"ANYSCALE_SESSION_ID": "ses_123"}, "anyscale"),
    ({"COURSE_PLATFORM": "binder", "CI": "1"}, "binder"),
])
def test_platform_detection(env, platform):
    assert detect(env).platform == platform


def test_sizes_follow_the_platform():
    assert detect({}).size == "cpu"              # a laptop without GPUs
    assert detect({"CI": "1"}).size == "smoke"
    assert detect({"COURSE_GRADING": "1"}).size == "smoke" and detect({"COURSE_GRADING": "1"}).grading
    # nbgrader's Validate button and autograde tell the kernel through NBGRADER_EXECUTION
    for execution in ("validate", "autograde"):
        assert detect({"NBGRADER_EXECUTION": execution}).grading
    assert not detect({"NBGRADER_EXECUTION": ""}).grading
    assert detect({"COURSE_SIZE": "gpu"}).sizes["train_samples"] == 60000
    with pytest.raises(ValueError, match="COURSE_SIZE"):
        detect({"COURSE_SIZE": "huge"})


def test_gpus_switch_device_backend_workers_and_size(monkeypatch):
    import coursekit.runtime as runtime

    monkeypatch.setattr(runtime, "_count_gpus", lambda: 4)
    rt = runtime.detect({})
    assert (rt.device, rt.backend, rt.default_workers, rt.size) == ("cuda", "nccl", 4, "gpu")


def test_storage_is_detected_not_hard_coded(tmp_path, monkeypatch):
    import coursekit.runtime as runtime

    assert detect({}, cwd=REPO).storage_path == str(REPO / "build" / "ray_results")
    assert detect({"COURSE_STORAGE": str(tmp_path)}).storage_path == str(tmp_path)
    # a bucket URI (what deploy/cluster.yaml tells users to set) reaches Ray Train unchanged
    assert detect({"COURSE_STORAGE": "s3://bucket/ray-train-course"}).storage_path == "s3://bucket/ray-train-course"
    # On Anyscale the cluster storage is used when it exists, and the cluster is joined.
    monkeypatch.setattr(runtime, "ANYSCALE_STORAGE", tmp_path)
    rt = runtime.detect({"ANYSCALE_SESSION_ID": "x"})
    assert rt.storage_path == str(tmp_path / "ray-train-course") and rt.ray_address == "auto"
    assert rt.data_dir == str(tmp_path / "data")


def test_small_machines_start_ray_lean():
    assert detect({"COURSE_PLATFORM": "binder"}).lean
    # Binder (a shared CPU, 2 GiB) runs what a laptop runs: the cpu sizes, which the suite runs every notebook at
    assert detect({"COURSE_PLATFORM": "binder"}).size == "cpu"
    assert detect({"COURSE_PLATFORM": "binder", "COURSE_SIZE": "smoke"}).size == "smoke"
    assert detect({"CI": "1"}).lean


def _cgroup_tree(tmp_path, files: dict[str, str], proc_cgroup: str):
    for rel, text in files.items():
        path = tmp_path / "sys" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "self_cgroup").write_text(proc_cgroup)
    return tmp_path / "sys", tmp_path / "self_cgroup"


@pytest.mark.parametrize("files, proc_cgroup, expected", [
    # cgroup v2 (Binder, Kubernetes on a recent node): 1.5 CPUs and 2 GiB set on the pod's group
    ({"cgroup.controllers": "cpu memory", "kubepods/pod1/cpu.max": "150000 100000",
      "kubepods/pod1/memory.max": str(2 * 2**30), "kubepods/cpu.max": "max 100000",
      "kubepods/memory.max": "max"},
     "0::/kubepods/pod1\n", (1.5, 2 * 2**30)),
    # cgroup v2 inside a container: /proc/self/cgroup says "/" and the limits sit at the mount's root
    ({"cgroup.controllers": "cpu memory", "cpu.max": "400000 100000", "memory.max": str(3 * 2**30)},
     "0::/\n", (4.0, 3 * 2**30)),
    # a tighter limit on a parent group wins
    ({"cgroup.controllers": "cpu memory", "a/memory.max": str(2**30), "a/b/memory.max": str(4 * 2**30)},
     "0::/a/b\n", (None, 2**30)),
    # cgroup v1 (older Docker hosts): quota/period and limit_in_bytes; -1 and 2**63 mean no limit
    ({"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "200000", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000",
      "memory/docker/x/memory.limit_in_bytes": str(6 * 2**30),
      "memory/memory.limit_in_bytes": "9223372036854771712"},
     "4:memory:/docker/x\n3:cpu,cpuacct:/docker/x\n0::/\n", (2.0, 6 * 2**30)),
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000",
      "memory/memory.limit_in_bytes": "9223372036854771712"},
     "4:memory:/\n1:cpu:/\n", (None, None)),
])
def test_cgroup_limits_are_read_from_v1_and_v2(tmp_path, files, proc_cgroup, expected):
    from coursekit.runtime import cgroup_limits

    sys_root, self_cgroup = _cgroup_tree(tmp_path, files, proc_cgroup)
    assert cgroup_limits(sys_root, self_cgroup) == expected


def test_detect_sizes_itself_by_the_containers_limits_not_the_hosts(monkeypatch):
    """Binder and Kubernetes pods show the host's CPUs and memory; Ray started for those would
    oversubscribe the container (workers that wait for CPUs, or an object store that does not fit)."""
    import coursekit.runtime as runtime

    monkeypatch.setattr(runtime, "cgroup_limits", lambda: (1.5, 2 * 2**30))
    rt = runtime.detect({"COURSE_PLATFORM": "local"})
    assert rt.num_cpus == 1 and rt.memory_gib == 2.0 and rt.lean
    monkeypatch.setattr(runtime, "cgroup_limits", lambda: (None, None))
    assert runtime.detect({}).memory_gib > 2.0


def test_a_machine_of_binders_size_runs_module_01s_two_nodes_on_the_small_cnn(monkeypatch):
    """Binder's 2 GiB holds the kernel, 2 torchrun agents and 2 ranks only with the small CNN (tests/test_notebooks.py
    measures the headroom); every other size of the profile stays the laptop's."""
    import coursekit.runtime as runtime

    binder = detect({"COURSE_PLATFORM": "binder"})
    assert binder.sizes["multinode_model"] == "small_cnn"
    assert {k: v for k, v in binder.sizes.items() if k != "multinode_model"} == {
        k: v for k, v in SIZES["cpu"].items() if k != "multinode_model"}
    assert detect({"COURSE_PLATFORM": "local"}).sizes["multinode_model"] == "resnet18"
    monkeypatch.setattr(runtime, "cgroup_limits", lambda: (None, 3 * 2**30))   # a laptop of 3 GiB
    assert runtime.detect({"COURSE_PLATFORM": "local"}).sizes["multinode_model"] == "small_cnn"
    monkeypatch.setattr(runtime, "_count_gpus", lambda: 2)                     # a GPU per rank: the real model
    assert runtime.detect({"COURSE_PLATFORM": "binder"}).sizes["multinode_model"] == "resnet18"


def test_worker_defaults_follow_the_workers_resources_not_the_driver():
    from coursekit.scaling import WorkerResources

    cpu_only, gpus = WorkerResources(cpus=8, gpus=0), WorkerResources(cpus=16, gpus=4)
    assert (cpu_only.use_gpu, cpu_only.default_workers, cpu_only.backend) == (False, 2, "gloo")
    assert (gpus.use_gpu, gpus.default_workers, gpus.backend) == (True, 4, "nccl")


def test_worker_resources_count_the_gpu_nodes_an_autoscaler_may_still_start(monkeypatch):
    """An autoscaling cluster (deploy/cluster.yaml: 0-4 GPU workers) runs no GPU node until asked for one."""
    import ray

    import coursekit.scaling as scaling

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 0.0, "memory": 1e9})   # the head alone
    monkeypatch.setattr(scaling, "_autoscaler_limits", lambda: {"CPU": 16, "GPU": 4})
    rt = detect({"RAY_ADDRESS": "", "COURSE_PLATFORM": "local"})
    workers = scaling.worker_resources(rt)
    assert (workers.cpus, workers.gpus, workers.default_workers, workers.backend) == (16, 4, 4, "nccl")
    # and the ScalingConfig check accepts 4 GPU workers there
    scaling.check_scaling(4, True, resources=scaling.cluster_resources(rt))


def _own_v1_group(controller: str):
    """This process's cgroup v1 folder for ``controller``, or None (no v1 hierarchy for it)."""
    from coursekit.runtime import own_cgroups

    return next((c.folder for c in own_cgroups(controller) if c.version == 1 and c.folder.is_dir()), None)


def test_detect_in_a_real_cgroup_sees_its_cpu_quota_and_memory_limit(tmp_path):
    """A child process placed in real cgroups (1.5 CPUs, 1.5 GiB), as a container runtime would place it."""
    import os
    import subprocess
    import uuid

    from helpers import PY

    made = []
    try:
        for controller, settings in (("memory", {"memory.limit_in_bytes": str(1536 * 2**20)}),
                                     ("cpu", {"cpu.cfs_quota_us": "150000", "cpu.cfs_period_us": "100000"})):
            parent = _own_v1_group(controller)
            if parent is None or not os.access(parent, os.W_OK):
                pytest.skip(f"no writable cgroup v1 '{controller}' hierarchy here")
            group = parent / f"course-test-{uuid.uuid4().hex[:8]}"
            group.mkdir()
            made.append(group)
            for name, value in settings.items():
                (group / name).write_text(value)
        enter = "; ".join(f"echo $$ > {g}/cgroup.procs" for g in made)
        probe = "from coursekit.runtime import detect; rt = detect(); print('RT', rt.num_cpus, rt.memory_gib, rt.lean)"
        proc = subprocess.run(["sh", "-c", f'{enter}; exec "$0" -c "$1"', PY, probe],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "RT 1 1.5 True" in proc.stdout, proc.stdout
    finally:
        for group in reversed(made):
            for _ in range(50):   # the child has exited; the kernel may take a moment to empty the group
                try:
                    group.rmdir()
                    break
                except OSError:
                    import time
                    time.sleep(0.1)


def test_the_repository_root_has_one_definition():
    import autograder.paths

    assert REPO_ROOT is REPO and autograder.paths.REPO is REPO
    assert (REPO / "coursekit" / "paths.py").is_file() and (REPO / "solutions").is_dir()


def test_inside_the_course_files_go_into_its_folder_elsewhere_into_the_users_cache(tmp_path):
    """A copy of a module's folder (a student's, or the one Validate runs) never writes into the course's folder:
    its data and results go into the user's cache, or where that cannot be written, its own folder."""
    inside = detect({}, cwd=REPO / "course" / "03_ray_data")
    assert (inside.data_dir, inside.storage_path) == (str(REPO / "data"), str(REPO / "build" / "ray_results"))
    copy = tmp_path / "my-course" / "03_ray_data"
    copy.mkdir(parents=True)
    cache = tmp_path / "cache"
    rt = detect({"XDG_CACHE_HOME": str(cache)}, cwd=copy)
    assert rt.data_dir == str(cache / "ray-train-course" / "data")
    assert rt.storage_path == str(cache / "ray-train-course" / "ray_results")
    home = tmp_path / "home"
    home.mkdir(mode=0o555)   # a read-only home, as in the grader's jail
    try:
        if os.access(home, os.W_OK):   # root writes anywhere: nothing to see
            return
        rt = detect({"XDG_CACHE_HOME": str(home / ".cache")}, cwd=copy)
        assert rt.data_dir == str(copy / ".ray-train-course" / "data")
    finally:
        home.chmod(0o755)
    # what is set wins wherever the work runs
    assert detect({"COURSE_DATA": str(tmp_path / "d")}, cwd=copy).data_dir == str(tmp_path / "d")


def test_the_course_switches_are_read_in_one_place():
    assert settings({}) == Settings(ray_verbose=False, start_method=None, record_file=None)
    got = settings({"COURSE_RAY_VERBOSE": "1", "COURSE_START_METHOD": "spawn", "COURSE_RECORD": "/tmp/r.json"})
    assert got == Settings(ray_verbose=True, start_method="spawn", record_file="/tmp/r.json")
    assert settings({"COURSE_RAY_VERBOSE": "0", "COURSE_RECORD": ""}) == Settings()   # the grader sets ""
    with pytest.raises(ValueError, match="COURSE_START_METHOD='forkserver' is not one of fork, spawn"):
        settings({"COURSE_START_METHOD": "forkserver"})


def test_no_other_module_reads_the_course_switches():
    """COURSE_* variables are read by coursekit.runtime only (raysetup copies them all to Ray's workers, and
    coursekit.notebooks sets COURSE_RECORD for the notebooks it runs)."""
    import re

    readers = []
    for path in sorted((REPO / "coursekit").rglob("*.py")):
        if path.name == "runtime.py" and path.parent.name == "coursekit":
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"(environ\.get\(|environ\[|getenv\()\s*[\"']COURSE_", line):
                readers.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not readers, readers
