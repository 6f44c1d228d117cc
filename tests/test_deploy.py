"""The files for running the course elsewhere are valid: Binder, the cluster launcher, KubeRay, Docker.

None of these can be started here (no cloud, no Kubernetes, no Docker daemon), so each is
checked by the validator its tool uses, or by the rules its tool enforces:
- deploy/cluster.yaml against the JSON schema that Ray ships (what `ray up` validates with);
- the KubeRay manifests for the fields the RayCluster/RayJob CRDs require and for
  consistency (volumes that exist, string-valued rayStartParams, one image, one Ray version);
- deploy/Dockerfile with hadolint;
- binder/ for what repo2docker reads, and for the same pins as requirements.txt.
Each validator is also shown a broken file, so that a check that cannot fail would be noticed.
"""
from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from conftest import PY, REPO, read_pins

DEPLOY = REPO / "deploy"
BINDER = REPO / "binder"
IMAGE = f"ray-train-course:{ray.__version__}"


# ---------------------------------------------------------------- cluster launcher

def _cluster() -> dict:
    return yaml.safe_load((DEPLOY / "cluster.yaml").read_text())


def _validate(config: dict) -> None:
    """What `ray up` does with the file: fill the provider's defaults, then validate against the schema."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(config))


def test_cluster_config_passes_rays_own_schema():
    _validate(_cluster())


def test_cluster_config_schema_check_rejects_a_broken_config():
    broken = _cluster()
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)
    broken = _cluster()
    del broken["available_node_types"]["head"]["node_config"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


def test_cluster_config_has_a_gpu_worker_type_a_dashboard_and_the_pinned_environment():
    c = _cluster()
    types = c["available_node_types"]
    assert c["head_node_type"] in types
    gpu = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu and all(t["max_workers"] <= c["max_workers"] for t in gpu)
    assert any("--dashboard-host=0.0.0.0" in cmd for cmd in c["head_start_ray_commands"])
    setup = "\n".join(c["setup_commands"])
    assert "-r ~/ray-train-course/requirements.txt" in setup  # pins ray[default,...]: dashboard, job server
    assert "~/ray-train-course" in [k.replace("/home/ubuntu", "~") for k in c["file_mounts"]]
    assert c["file_mounts"]["/home/ubuntu/ray-train-course"] == "."
    assert "COURSE_STORAGE" in setup  # checkpoints need storage every node reaches


# ---------------------------------------------------------------- KubeRay

def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / name).read_text()) if d]


def _group_problems(where: str, group: dict) -> list[str]:
    problems = []
    params = group.get("rayStartParams", {})
    if not isinstance(params, dict):
        problems.append(f"{where}.rayStartParams must be a map")
    else:
        problems += [f"{where}.rayStartParams.{k} must be a string (the CRD says map of strings), got {v!r}"
                     for k, v in params.items() if not isinstance(v, str)]
    pod = group.get("template", {}).get("spec")
    if not pod or not pod.get("containers"):
        return problems + [f"{where}.template.spec.containers is required"]
    names = {v["name"] for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        if not c.get("name") or not c.get("image"):
            problems.append(f"{where}: every container needs a name and an image")
        if c.get("image") != IMAGE:
            problems.append(f"{where}: image {c.get('image')!r} is not the course image {IMAGE}")
        for m in c.get("volumeMounts", []):
            if m["name"] not in names:
                problems.append(f"{where}: volumeMount {m['name']!r} has no volume")
        mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        if "/mnt/cluster_storage" not in mounts:
            problems.append(f"{where}: the shared volume is not mounted at /mnt/cluster_storage")
        if not str(env.get("COURSE_STORAGE", "")).startswith("/mnt/cluster_storage/"):
            problems.append(f"{where}: COURSE_STORAGE must point into the shared volume")
    return problems


def raycluster_spec_problems(spec: dict, where: str = "spec") -> list[str]:
    """What the RayCluster CRD (ray.io/v1) and the course require of a cluster spec."""
    problems = []
    if spec.get("rayVersion") != ray.__version__:
        problems.append(f"{where}.rayVersion must be {ray.__version__} (the image's Ray)")
    head = spec.get("headGroupSpec")
    if not head:
        return problems + [f"{where}.headGroupSpec is required"]
    problems += _group_problems(f"{where}.headGroupSpec", head)
    groups = spec.get("workerGroupSpecs", [])
    if not groups:
        problems.append(f"{where}.workerGroupSpecs: no workers to train on")
    for i, g in enumerate(groups):
        w = f"{where}.workerGroupSpecs[{i}]"
        if not g.get("groupName"):
            problems.append(f"{w}.groupName is required")
        if not (g.get("minReplicas", 0) <= g.get("replicas", 0) <= g.get("maxReplicas", 2**31)):
            problems.append(f"{w}: minReplicas <= replicas <= maxReplicas does not hold")
        problems += _group_problems(w, g)
        limits = [c.get("resources", {}).get("limits", {}) for c in g["template"]["spec"]["containers"]]
        if not any("nvidia.com/gpu" in lim for lim in limits):
            problems.append(f"{w}: no nvidia.com/gpu limit, Ray will not see GPUs")
    return problems


def manifest_problems(doc: dict) -> list[str]:
    if doc.get("apiVersion") != "ray.io/v1":
        return [f"apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}"]
    if not doc.get("metadata", {}).get("name"):
        return ["metadata.name is required"]
    if doc["kind"] == "RayCluster":
        return raycluster_spec_problems(doc.get("spec", {}))
    if doc["kind"] == "RayJob":
        spec = doc.get("spec", {})
        problems = [] if spec.get("entrypoint") else ["spec.entrypoint is required"]
        if "rayClusterSpec" not in spec and "clusterSelector" not in spec:
            problems.append("spec needs rayClusterSpec or clusterSelector")
        if "rayClusterSpec" in spec:
            problems += raycluster_spec_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
        return problems
    return [f"unexpected kind {doc.get('kind')!r}"]


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_kuberay_manifests_have_what_the_crds_and_the_course_need(name):
    (doc,) = _docs(name)
    assert manifest_problems(doc) == []


def test_kuberay_checks_catch_the_usual_mistakes():
    (doc,) = _docs("raycluster.yaml")
    broken = copy.deepcopy(doc)
    broken["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0            # unquoted number
    broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]["volumes"] = []      # mount without volume
    broken["spec"]["workerGroupSpecs"][0]["minReplicas"] = 5                       # min > replicas
    problems = "\n".join(manifest_problems(broken))
    assert "must be a string" in problems and "has no volume" in problems and "minReplicas" in problems


def test_the_shared_volume_claim_is_the_one_the_pods_mount():
    (pvc,) = _docs("shared-storage.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and "ReadWriteMany" in pvc["spec"]["accessModes"]
    claims = set()
    for name in ("raycluster.yaml", "rayjob.yaml"):
        text = (DEPLOY / "kuberay" / name).read_text()
        claims |= set(re.findall(r"claimName:\s*(\S+)", text))
    assert claims == {pvc["metadata"]["name"]}


def test_rayjob_runs_a_script_that_exists_in_the_image():
    (job,) = _docs("rayjob.yaml")
    script = job["spec"]["entrypoint"].split()[1]
    rel = script.split("/home/ray/ray-train-course/", 1)[1]
    assert (REPO / rel).exists(), f"the RayJob runs {rel}, which the image does not contain"
    assert "COPY course ./course" in (DEPLOY / "Dockerfile").read_text()


# ---------------------------------------------------------------- Docker

def test_dockerfile_passes_hadolint():
    hadolint = Path(PY).parent / "hadolint"
    proc = subprocess.run([str(hadolint), "-c", str(DEPLOY / ".hadolint.yaml"), str(DEPLOY / "Dockerfile")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_hadolint_rejects_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install wget\nRUN cd /tmp && pip install torch\n")
    proc = subprocess.run([str(Path(PY).parent / "hadolint"), "-c", str(DEPLOY / ".hadolint.yaml"), str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode != 0 and "DL3007" in proc.stdout  # "latest" tag


def test_dockerfile_installs_the_pinned_environment_on_the_course_python():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11[.\d]*-slim", text, re.M)
    assert "pip install --no-cache-dir -r requirements.txt" in text


# ---------------------------------------------------------------- Binder

def test_binder_uses_cpu_torch_of_the_pinned_versions_and_otherwise_the_same_requirements():
    text = (BINDER / "requirements.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text
    assert "-r ../requirements.txt" in text
    main, binder = read_pins(REPO / "requirements.txt"), read_pins(BINDER / "requirements.txt", strict=False)
    for pkg in ("torch", "torchvision"):
        assert binder[pkg] == f"{main[pkg]}+cpu", f"binder must pin the CPU build of {pkg}=={main[pkg]}"
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"


def test_binder_registers_the_course_kernel_and_starts_in_binder_mode():
    post = (BINDER / "postBuild").read_text()
    # the course kernel and the Validate button's settings (coursekit/jupyter_setup.py, KERNEL)
    assert "coursekit.jupyter_setup --sys-prefix" in post and "pip install" in post and "-e ." in post
    import nbformat
    nb = nbformat.read(next((REPO / "course").glob("*/*.ipynb")), as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "ray-train-course"
    for script in ("postBuild", "start"):
        assert (BINDER / script).stat().st_mode & 0o111, f"binder/{script} must be executable"
    # `start` wraps JupyterLab: what it exports is what the kernels see
    env = subprocess.run(["bash", str(BINDER / "start"), "env"], capture_output=True, text=True, check=True).stdout
    assert "COURSE_PLATFORM=binder" in env
    from coursekit.runtime import detect
    rt = detect({"COURSE_PLATFORM": "binder", "CUDA_VISIBLE_DEVICES": ""})
    assert rt.platform == "binder" and rt.lean and rt.default_workers == 2


def test_readme_binder_badge_opens_the_first_notebook_of_the_course():
    import re
    readme = (REPO / "README.md").read_text()
    badge = re.search(r"\[!\[Binder\]\(https://mybinder\.org/badge_logo\.svg\)\]\((https://mybinder\.org/v2/gh/[^)]+)\)",
                      readme)
    assert badge, "the README needs a Binder badge near the top"
    assert readme.index(badge.group(0)) < readme.index("## The course")
    urlpath = re.search(r"[?&]urlpath=lab/tree/([^&)]+)", badge.group(1))
    assert urlpath and urlpath.group(1) == "course/01_ddp_pytorch/01_ddp_pytorch.ipynb"
    assert (REPO / urlpath.group(1)).is_file()
