"""Runtime detection: platform, device/backend, sizes and storage come from one place."""
import pytest

from coursekit.runtime import REPO_ROOT, SIZES, detect


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

    assert detect({}).storage_path == str(REPO_ROOT / "build" / "ray_results")
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
    # Binder (a shared CPU, 2 GiB) uses the small sizes unless the student asks for more
    assert detect({"COURSE_PLATFORM": "binder"}).size == "smoke"
    assert detect({"COURSE_PLATFORM": "binder", "COURSE_SIZE": "cpu"}).size == "cpu"
    assert detect({"CI": "1"}).lean
