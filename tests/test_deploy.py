"""The files for running the course elsewhere are valid: Binder, the cluster launcher, KubeRay, Docker.

None of these can be started here (no cloud, no Kubernetes, no Docker daemon), so each is
checked by the validator its tool uses, or by the rules its tool enforces:
- deploy/cluster.yaml (a template that deploy/up.py renders with the student's COURSE_STORAGE) against
  the JSON schema that Ray ships (what `ray up` validates with), and its storage commands run in a shell;
- the KubeRay manifests against the OpenAPI schemas of KubeRay's published CRDs (tests/kuberay_crds/, v1.7.0,
  with jsonschema, unknown fields refused as `kubectl apply --validate=strict` refuses them), and for the course's
  needs (volumes that exist, the image variant per group, one Ray version, replica bounds that mean something);
- deploy/Dockerfile with hadolint, and for its base (Ray's own image of the pinned Ray) and variants;
- binder/ for what repo2docker reads, and for the same pins as requirements.txt.
Each validator is also shown a broken file, so that a check that cannot fail would be noticed.
"""
from __future__ import annotations

import copy
import functools
import gzip
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

from helpers import PY, REPO, read_pins

DEPLOY = REPO / "deploy"
BINDER = REPO / "binder"
# deploy/Dockerfile's two variants: the CPU one for heads and CPU groups, the GPU one where pods get GPUs
IMAGES = {"cpu": f"ray-train-course:{ray.__version__}-cpu", "gpu": f"ray-train-course:{ray.__version__}-gpu"}
STORAGE = "s3://course-bucket/ray-train-course"


def _load_up():
    """deploy/up.py, the launcher that renders deploy/cluster.yaml (deploy/ is not a package)."""
    spec = importlib.util.spec_from_file_location("deploy_up", DEPLOY / "up.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


up = _load_up()


# ---------------------------------------------------------------- cluster launcher

def _cluster(storage: str = STORAGE) -> dict:
    """The config `ray up` gets: deploy/cluster.yaml rendered by deploy/up.py."""
    return yaml.safe_load(up.render(up.check_storage(storage)))


def _validate(config: dict) -> None:
    """What `ray up` does with the file: fill the provider's defaults, then validate against the schema."""
    from coursekit.ray_internals import prepare_config, validate_config

    validate_config(prepare_config(config))


def test_cluster_config_passes_rays_own_schema():
    _validate(_cluster())
    _validate(yaml.safe_load((DEPLOY / "cluster.yaml").read_text()))  # the template: placeholders in strings only


def test_cluster_config_schema_check_rejects_a_broken_config():
    broken = _cluster()
    broken["available_node_types"]["gpu_worker"]["resources"]["GPU"] = "one"
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)
    broken = _cluster()
    del broken["available_node_types"]["head"]["node_config"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(broken)


def test_cluster_config_has_a_gpu_worker_type_a_dashboard_and_the_course_set():
    c = _cluster()
    types = c["available_node_types"]
    assert c["head_node_type"] in types
    # the head runs the driver and Ray's control plane: it advertises no CPUs for training and has no GPU
    assert types[c["head_node_type"]]["resources"] == {"CPU": 0}
    gpu = [t for t in types.values() if t["resources"].get("GPU", 0) >= 1]
    assert gpu and all(t["max_workers"] <= c["max_workers"] for t in gpu)
    assert any("--dashboard-host=0.0.0.0" in cmd for cmd in c["head_start_ray_commands"])
    head, workers = "\n".join(c["head_setup_commands"]), "\n".join(c["worker_setup_commands"])
    # requirements.txt pins ray[default,...]: dashboard, job server; the head gets the CPU build of torch
    assert "pip install -q -r ~/ray-train-course/binder/requirements.txt" in head
    assert "pip install -q -r ~/ray-train-course/requirements.txt" in workers
    for setup in (head, workers):
        assert "requirements-dev" not in setup                  # nodes get the course set, no test tools
        assert "uninstall -q -y rfc3987-syntax" in setup
        assert "-e ~/ray-train-course" in setup
        for ref in re.findall(r"~/ray-train-course/(\S+)", setup):
            assert (REPO / ref).exists(), f"a setup command installs {ref}, which the repository does not have"
    assert c["file_mounts"] == {"~/ray-train-course": "."}
    assert "build" in c["rsync_exclude"]                       # the rendered config stays on the laptop


def _dockerfile_base() -> tuple[str, set[str]]:
    """deploy/Dockerfile's base image name (with ${VARIANT} left in) and the variants its header builds."""
    text = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^FROM (\S+)", text, re.M).group(1)
    variants = set(re.findall(r"--build-arg VARIANT=(\w+)", text)) | {re.search(r"^ARG VARIANT=(\w+)", text, re.M)[1]}
    return base, variants


def node_image_problems(c: dict) -> list[str]:
    """What keeps the nodes from running the course: `latest_dlami` is what Ray 2.60 maps to an Ubuntu 18.04
    deep-learning image (glibc 2.27: no torch 2.14 wheel installs there). The nodes boot AWS's current
    Ubuntu 22.04 base DLAMI through its public SSM parameter, and everything runs in Ray's image of the
    pinned versions, the base of deploy/Dockerfile."""
    problems = []
    for name, t in c["available_node_types"].items():
        ami = t["node_config"].get("ImageId", "")
        if not (ami.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/")
                and re.search(r"ubuntu-(22|24)\.04/latest/ami-id$", ami)):
            problems.append(f"{name}: ImageId {ami!r} is not AWS's current Ubuntu 22.04+ base DLAMI parameter")
        # the containers need the instance profile's credentials (S3 storage, the autoscaler): IMDSv2 via a hop
        if t["node_config"].get("MetadataOptions", {}).get("HttpPutResponseHopLimit", 1) < 2:
            problems.append(f"{name}: the containers cannot reach IMDSv2 (HttpPutResponseHopLimit < 2)")
    base, variants = _dockerfile_base()
    py = "py%d%d" % sys.version_info[:2]
    docker = c.get("docker", {})
    images = {docker.get("head_image"), docker.get("worker_image")}
    if images != {base.replace("${VARIANT}", "cpu"), base.replace("${VARIANT}", "cu128")}:
        problems.append(f"images {sorted(map(str, images))} are not deploy/Dockerfile's base in its cpu and cu128 variants")
    if not all(str(i).startswith(f"rayproject/ray:{ray.__version__}-{py}-") for i in images):
        problems.append(f"images {sorted(map(str, images))} are not Ray {ray.__version__} on {py}")
    if "cu128" not in variants:
        problems.append("deploy/Dockerfile does not describe the cu128 variant the GPU workers run")
    # in the container: the image's own Python and Ray, no venv of the old host setup
    commands = [*c["setup_commands"], *c.get("head_setup_commands", []), *c.get("worker_setup_commands", []),
                *c["head_start_ray_commands"], *c["worker_start_ray_commands"]]
    problems += [f"a command sets up the host, not the container: {cmd}" for cmd in commands
                 if "venv" in cmd or "apt-get" in cmd]
    return problems


def test_every_node_boots_a_current_ami_and_runs_rays_image_of_the_pinned_ray_and_python():
    assert node_image_problems(_cluster()) == []


def test_the_node_image_check_rejects_the_old_setup():
    broken = _cluster()
    broken["available_node_types"]["gpu_worker"]["node_config"]["ImageId"] = "latest_dlami"
    del broken["available_node_types"]["head"]["node_config"]["MetadataOptions"]
    broken["docker"]["worker_image"] = "rayproject/ray:2.50.0-py311-gpu"
    broken["setup_commands"].append("python3.11 -m venv ~/venv")
    problems = "\n".join(node_image_problems(broken))
    for expected in ("gpu_worker: ImageId 'latest_dlami'", "head: the containers cannot reach IMDSv2",
                     "cpu and cu128 variants", "not Ray", "sets up the host"):
        assert expected in problems, expected


def _storage_commands(config: dict) -> list[str]:
    """setup_commands run on every node, head and workers, before `ray start`."""
    return [cmd for cmd in config["setup_commands"] if "COURSE_STORAGE" in cmd or "ray-train-course.env" in cmd]


def _run_setup(commands: list[str], home: Path) -> subprocess.CompletedProcess:
    """The setup commands as Ray's command runner runs them on a node: one shell per command, in order."""
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    for cmd in commands:
        proc = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True)
        if proc.returncode:
            return proc
    return proc


def _node_env(home: Path) -> str:
    """COURSE_STORAGE in a node's login shell (what `ray start` and `ray submit` run in)."""
    return subprocess.run(["bash", "-c", 'source ~/.bashrc; printf %s "$COURSE_STORAGE"'],
                          env={"HOME": str(home), "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, check=True).stdout


def test_the_students_storage_reaches_every_node(tmp_path):
    commands = _storage_commands(_cluster())
    assert len(commands) >= 3 and commands[0].startswith("case ")  # the template check comes first
    assert _run_setup(commands, tmp_path).returncode == 0
    assert _node_env(tmp_path) == STORAGE
    # `ray up` again with other storage: the nodes' value follows, the shell profile gets one line
    other = "/mnt/efs/ray-train-course"
    assert _run_setup(_storage_commands(_cluster(other)), tmp_path).returncode == 0
    assert _node_env(tmp_path) == other
    assert (tmp_path / ".bashrc").read_text().count("ray-train-course.env") == 1


def test_ray_up_on_the_unrendered_template_stops_at_its_first_setup_command(tmp_path):
    template = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    proc = _run_setup(template["setup_commands"][:1], tmp_path)
    assert proc.returncode != 0 and "deploy/up.py" in proc.stderr


@pytest.mark.parametrize("storage", ["s3://bucket/ray-train-course", "gs://b/p", "abfss://c@a.dfs.core.windows.net/x",
                                     "/mnt/efs/ray-train-course"])
def test_up_accepts_bucket_uris_and_absolute_shared_paths(storage):
    assert up.check_storage(storage) == storage


@pytest.mark.parametrize("storage", [None, "", "s3://CHANGE-ME/ray-train-course", "s3://change-me/x",
                                     "build/ray_results", "~/results", "s3://b/$HOME", "s3://b/a b",
                                     "s3://b/'x'", "s3://b/x#y", "s3:///no-bucket"])
def test_up_refuses_storage_the_nodes_cannot_use(storage):
    with pytest.raises(up.StorageError):
        up.check_storage(storage)


def test_up_renders_into_build_and_refuses_to_start_without_storage(tmp_path):
    out = tmp_path / "cluster.yaml"
    cmd = [PY, str(DEPLOY / "up.py"), "--render-only", "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k != "COURSE_STORAGE"}
    for storage in (None, "s3://CHANGE-ME/ray-train-course"):
        run_env = env if storage is None else {**env, "COURSE_STORAGE": storage}
        proc = subprocess.run(cmd, env=run_env, capture_output=True, text=True)
        assert proc.returncode == 2 and "COURSE_STORAGE" in proc.stderr and "deploy/up.py" in proc.stderr
        assert not out.exists()
    proc = subprocess.run(cmd, env={**env, "COURSE_STORAGE": STORAGE}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text() == up.render(STORAGE)
    assert "IamInstanceProfile" in proc.stderr  # S3 with workers that have no instance profile: told so
    assert up.RENDERED == REPO / "build" / "cluster.yaml"


def test_the_cluster_commands_are_documented_with_the_rendered_config():
    header = (DEPLOY / "cluster.yaml").read_text().split("\ncluster_name:")[0]
    assert "python deploy/up.py" in header
    for command in ("ray submit", "ray down", "ray dashboard"):
        assert f"{command} build/cluster.yaml" in header, command
    readme = (REPO / "README.md").read_text()
    assert "python deploy/up.py" in readme and "ray submit build/cluster.yaml" in readme
    assert "ray down build/cluster.yaml" in readme


# ---------------------------------------------------------------- KubeRay

def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kuberay" / name).read_text()) if d]


CRDS = Path(__file__).parent / "kuberay_crds"


def _strict(schema):
    """The CRD's schema with unknown fields refused: the API server drops a field it does not know (a typo such as
    `minReplica` would silently do nothing); `kubectl apply --validate=strict` refuses it, and so does this."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k == "properties" else _strict(v)) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: _strict(s) for name, s in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft4Validator:
    """jsonschema's validator for KubeRay's CRD of ``kind`` (its OpenAPI v3 schema, version ray.io/v1)."""
    data = json.loads(gzip.decompress((CRDS / f"{kind.lower()}s.json.gz").read_bytes()))
    assert data["kind"] == kind
    return jsonschema.Draft4Validator(_strict(data["openAPIV3Schema"]))


def schema_problems(doc: dict) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}"
            for e in crd_validator(doc["kind"]).iter_errors(doc)]


def _group_problems(where: str, group: dict) -> list[str]:
    """The course's needs of a head or worker group (the CRD's own rules are in schema_problems)."""
    problems = []
    pod = group.get("template", {}).get("spec")
    if not pod or not pod.get("containers"):
        return problems + [f"{where}.template.spec.containers is required"]
    names = {v["name"] for v in pod.get("volumes", [])}
    for c in pod["containers"]:
        image = IMAGES["gpu" if "nvidia.com/gpu" in c.get("resources", {}).get("limits", {}) else "cpu"]
        if c.get("image") != image:
            problems.append(f"{where}: image {c.get('image')!r} is not the course image {image}")
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
    """What the course requires of a RayCluster spec, beyond the CRD's schema."""
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
        if not (g.get("minReplicas", 0) <= g.get("replicas", 0) <= g.get("maxReplicas", 2**31)):
            problems.append(f"{w}: minReplicas <= replicas <= maxReplicas does not hold")
        if g.get("minReplicas", 0) != g.get("maxReplicas", 2**31) and not spec.get("enableInTreeAutoscaling"):
            problems.append(f"{w}: minReplicas/maxReplicas do nothing without enableInTreeAutoscaling: true "
                            "(enable it, or give the group a fixed size)")
        problems += _group_problems(w, g)
        limits = [c.get("resources", {}).get("limits", {}) for c in g["template"]["spec"]["containers"]]
        if not any("nvidia.com/gpu" in lim for lim in limits):
            problems.append(f"{w}: no nvidia.com/gpu limit, Ray will not see GPUs")
    return problems


def manifest_problems(doc: dict) -> list[str]:
    if doc.get("apiVersion") != "ray.io/v1":
        return [f"apiVersion must be ray.io/v1, got {doc.get('apiVersion')!r}"]
    if doc.get("kind") not in ("RayCluster", "RayJob"):
        return [f"unexpected kind {doc.get('kind')!r}"]
    problems = schema_problems(doc)
    if not doc.get("metadata", {}).get("name"):
        problems.append("metadata.name is required")
    spec = doc.get("spec", {})
    if doc["kind"] == "RayCluster":
        return problems + raycluster_spec_problems(spec)
    if not spec.get("entrypoint"):
        problems.append("spec.entrypoint is required")
    if "rayClusterSpec" not in spec and "clusterSelector" not in spec:
        problems.append("spec needs rayClusterSpec or clusterSelector")
    if "rayClusterSpec" in spec:
        problems += raycluster_spec_problems(spec["rayClusterSpec"], "spec.rayClusterSpec")
    return problems


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
    broken["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["image"] = IMAGES["cpu"]
    broken["spec"]["workerGroupSpecs"][0]["maxReplica"] = 8                        # a typo the server would drop
    broken["spec"]["autoscalerOptions"]["upscalingMode"] = "Fast"                  # not one of the CRD's values
    problems = "\n".join(manifest_problems(broken))
    assert "0 is not of type 'string'" in problems and "has no volume" in problems and "minReplicas" in problems
    assert f"is not the course image {IMAGES['gpu']}" in problems                  # GPU pods, CPU image
    assert "'maxReplica' was unexpected" in problems and "'Fast' is not one of" in problems
    del broken["spec"]["workerGroupSpecs"][0]["groupName"]                         # required by the CRD
    assert "'groupName' is a required property" in "\n".join(manifest_problems(broken))
    fixed = copy.deepcopy(doc)                                                     # bounds without the autoscaler
    del fixed["spec"]["enableInTreeAutoscaling"], fixed["spec"]["autoscalerOptions"]
    assert any("do nothing without enableInTreeAutoscaling" in p for p in manifest_problems(fixed))


def test_the_interactive_cluster_autoscales_and_the_job_has_a_fixed_size():
    (cluster,) = _docs("raycluster.yaml")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["minReplicas"] == 0 < group["maxReplicas"]                        # no idle GPU pods
    (job,) = _docs("rayjob.yaml")
    (group,) = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert group["minReplicas"] == group["replicas"] == group["maxReplicas"]
    workers = re.search(r"--num-workers (\d+)", job["spec"]["entrypoint"])[1]
    assert int(workers) <= group["replicas"], "the job asks for more GPU workers than its cluster has"


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
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^WORKDIR /home/ray/ray-train-course$", text, re.M)
    assert re.search(r"^COPY (--chown=\S+ )?course \./course$", text, re.M)


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


def test_dockerfile_starts_from_rays_image_of_the_pinned_ray_and_python():
    text = (DEPLOY / "Dockerfile").read_text()
    pinned = read_pins(REPO / "requirements.txt")["ray"]
    assert pinned == ray.__version__
    (base,) = re.findall(r"^FROM (\S+)", text, re.M)
    assert base == f"rayproject/ray:{pinned}-py311-${{VARIANT}}"
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)       # the default build is the CPU variant


def test_dockerfile_describes_both_variants_with_the_images_the_manifests_use():
    text = (DEPLOY / "Dockerfile").read_text()
    builds = re.findall(r"docker build -f deploy/Dockerfile (.*?)-t (\S+) \.", text)
    variants = {tag: re.search(r"--build-arg VARIANT=(\S+)", args) for args, tag in builds}
    assert set(variants) == set(IMAGES.values())
    assert variants[IMAGES["cpu"]] is None                       # the default: VARIANT=cpu
    assert re.fullmatch(r"cu\d{3}", variants[IMAGES["gpu"]].group(1))  # a CUDA base Ray publishes (cu128, ...)
    used = set()
    for name in ("raycluster.yaml", "rayjob.yaml"):
        used |= set(re.findall(r"image:\s*(\S+)", (DEPLOY / "kuberay" / name).read_text()))
    assert used == set(IMAGES.values())


def test_dockerfile_installs_the_course_set_as_rays_user():
    text = (DEPLOY / "Dockerfile").read_text()
    # CPU: PyTorch's CPU builds of the pinned versions (binder's file); GPU: requirements.txt, PyPI's CUDA build
    assert "pip install --no-cache-dir -r binder/requirements.txt" in text
    assert "pip install --no-cache-dir -r requirements.txt" in text
    assert "requirements-dev" not in text                     # no test or lint tools in the image
    assert "pip uninstall --yes rfc3987-syntax" in text
    # Ray's image runs as `ray` (uid 1000, gid 100), who owns its Python: nothing switches to root
    assert all(u in ("1000", "ray", "1000:100") for u in re.findall(r"^USER (\S+)", text, re.M))
    assert "sudo" not in text
    copies = re.findall(r"^COPY (.*)$", text, re.M)
    assert copies and all(c.startswith("--chown=1000:100 ") for c in copies)


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
    # a student's JupyterLab (tests/test_lab.py serves it through `make lab`)
    path = re.search(r"^JUPYTER_CONFIG_PATH=(.*)$", env, re.M)[1].split(":")
    assert Path(path[0]) == REPO / "coursekit" / "student_view" and (Path(path[0]) / "labconfig").is_dir()
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
