"""The grader's own cluster files (autograder/deploy/): the image every grading node runs and the KubeRay RayJob
that grades a class. Nothing here can start a cluster (no Docker daemon, no Kubernetes): each file is checked by
the tool its runtime would use (hadolint) or against what the RayJob CRD, the grader's command line and the jail
need, and each check is shown a broken file too. tests/test_grading_cluster.py grades on a real local Ray
cluster."""
from __future__ import annotations

import copy
import shlex
import subprocess
from pathlib import Path

import pytest
import ray
import yaml

from autograder.grade import DEFAULT_MEMORY, parser
from autograder.student_release import PARTS
from helpers import PY, REPO

HERE = REPO / "autograder" / "deploy"
IMAGE = f"ray-train-course-grader:{ray.__version__}"


def _job() -> dict:
    (doc,) = [d for d in yaml.safe_load_all((HERE / "rayjob.yaml").read_text()) if d]
    return doc


def _containers(spec: dict) -> list[tuple[str, dict, dict]]:
    groups = [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]
    return [(name, g, c) for name, g in groups for c in g["template"]["spec"]["containers"]]


def rayjob_problems(job: dict) -> list[str]:
    """What KubeRay's RayJob CRD and the grader need of the manifest."""
    problems = []
    if job.get("apiVersion") != "ray.io/v1" or job.get("kind") != "RayJob":
        return ["not a ray.io/v1 RayJob"]
    spec = job["spec"]
    argv = shlex.split(spec.get("entrypoint", ""))
    if argv[:3] != ["python", "-m", "autograder.grade"]:
        return [f"the entrypoint does not run the grader: {spec.get('entrypoint')!r}"]
    try:
        args = parser().parse_args(argv[3:])
    except SystemExit:
        return [f"the grader refuses the entrypoint's arguments: {argv[3:]}"]
    if args.address != "auto":
        problems.append("the driver must grade on the cluster it runs in (--address auto)")
    cluster = spec["rayClusterSpec"]
    if cluster.get("rayVersion") != ray.__version__:
        problems.append(f"rayVersion must be {ray.__version__}")
    head = cluster["headGroupSpec"]
    mounts = {m["mountPath"] for c in head["template"]["spec"]["containers"] for m in c.get("volumeMounts", [])}
    for path in (args.submissions, args.out):
        if not any(Path(path).is_relative_to(m) for m in mounts):
            problems.append(f"{path} is on no volume the head (the driver) mounts")
    memory = args.memory * 2**30 if args.memory else DEFAULT_MEMORY
    for name, group, c in _containers(cluster):
        if c.get("image") != IMAGE:
            problems.append(f"{name}: image {c.get('image')!r} is not the grader's {IMAGE}")
        params = group.get("rayStartParams", {})
        problems += [f"{name}: rayStartParams.{k} must be a string" for k, v in params.items() if not isinstance(v, str)]
        if name == "head":
            continue
        limits = c.get("resources", {}).get("limits", {})
        if _bytes(limits.get("memory", "0")) - int(params.get("object-store-memory", 0)) < memory:
            problems.append(f"{name}: a pod's memory less its object store holds no job of {memory / 2**30:g} GiB")
        seccomp = c.get("securityContext", {}).get("seccompProfile", {}).get("type")
        if seccomp != "Unconfined":
            problems.append(f"{name}: without seccompProfile Unconfined bubblewrap cannot make namespaces")
    return problems


def _bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if str(quantity).endswith(suffix):
            return int(float(str(quantity)[:-2]) * factor)
    return int(quantity)


def test_the_grading_rayjob_runs_the_grader_on_its_own_cluster_with_the_jail():
    assert rayjob_problems(_job()) == []


def test_the_rayjob_check_catches_the_usual_mistakes():
    broken = copy.deepcopy(_job())
    spec = broken["spec"]
    spec["entrypoint"] = spec["entrypoint"].replace("--address auto", "--address 10.0.0.1:6379").replace(
        "/mnt/cluster_storage/grading", "/home/ray/grading")
    worker = spec["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    del worker["securityContext"]
    worker["resources"]["limits"]["memory"] = "4Gi"
    spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["image"] = "rayproject/ray:2.60.0"
    problems = "\n".join(rayjob_problems(broken))
    for expected in ("--address auto", "/home/ray/grading is on no volume", "seccompProfile",
                     "holds no job of 6 GiB", "is not the grader's"):
        assert expected in problems, (expected, problems)
    spec["entrypoint"] = "python -m autograder.grade --no-such-flag"
    assert "refuses" in "\n".join(rayjob_problems(broken))


def test_the_pvc_the_rayjob_mounts_is_the_courses_shared_volume():
    (pvc,) = [d for d in yaml.safe_load_all((REPO / "deploy" / "kuberay" / "shared-storage.yaml").read_text()) if d]
    head = _job()["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert {v["persistentVolumeClaim"]["claimName"] for v in head["volumes"]} == {pvc["metadata"]["name"]}


@pytest.mark.parametrize("broken", [False, True])
def test_the_grader_image_passes_hadolint(tmp_path, broken):
    dockerfile = HERE / "Dockerfile"
    if broken:          # an unpinned pip install: hadolint must refuse it, or this check tests nothing
        dockerfile = tmp_path / "Dockerfile"
        dockerfile.write_text((HERE / "Dockerfile").read_text() + "RUN pip install requests\n")
    proc = subprocess.run([str(Path(PY).parent / "hadolint"), "-c", str(REPO / "deploy" / ".hadolint.yaml"),
                           str(dockerfile)], capture_output=True, text=True)
    assert (proc.returncode != 0) == broken, proc.stdout + proc.stderr


def test_the_grader_image_has_the_jail_the_grader_and_what_the_driver_reads():
    text = (HERE / "Dockerfile").read_text()
    assert f"FROM rayproject/ray:{ray.__version__}-py311-cpu" in text
    assert "apt-get install -y --no-install-recommends bubblewrap" in text
    for folder in ("autograder", "coursekit", "solutions"):
        assert f"COPY --chown=1000:100 {folder} ./{folder}" in text, folder
    assert "coursekit.jupyter_setup --sys-prefix" in text and "pip install --no-cache-dir --no-deps" in text
    assert "autograder" not in PARTS and "solutions" not in PARTS, "the student release must not hold the grader"
