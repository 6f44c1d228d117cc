"""ScalingConfig checks and the widget, driven headless by setting control values."""
import pytest
from ray.train import ScalingConfig

from coursekit.scaling import ScalingConfigPicker, ScalingError, check_scaling, make_scaling_config

CPU_BOX = {"CPU": 2, "GPU": 0}
GPU_NODE = {"CPU": 16, "GPU": 4}


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_workers=3, use_gpu=False), "3 workers x 1 CPU each = 3 CPUs, but this cluster has 2"),
    (dict(num_workers=2, use_gpu=True), "no GPUs. Set use_gpu=False"),
    (dict(num_workers=0, use_gpu=False), "at least 1"),
    (dict(num_workers=2, use_gpu=False, global_batch_size=63), "does not split evenly over 2 workers"),
    (dict(num_workers=2, use_gpu=False, global_batch_size=1), "cannot feed 2 workers"),
    (dict(num_workers=1, use_gpu=False, cpus_per_worker=0), "must be > 0"),
])
def test_impossible_choices_are_explained(kwargs, match):
    with pytest.raises(ScalingError, match=match):
        check_scaling(resources=CPU_BOX, **kwargs)


def test_too_many_gpu_workers():
    with pytest.raises(ScalingError, match="8 GPU workers need 8 GPUs .* has 4"):
        check_scaling(8, True, resources=GPU_NODE)


def test_possible_choices_give_real_scaling_configs():
    sc = make_scaling_config(2, False, resources=CPU_BOX, global_batch_size=64)
    assert isinstance(sc, ScalingConfig)
    assert (sc.num_workers, sc.use_gpu, sc.resources_per_worker) == (2, False, {"CPU": 1})
    sc = make_scaling_config(4, False, cpus_per_worker=0.5, resources=CPU_BOX)
    assert sc.num_workers == 4 and sc.resources_per_worker == {"CPU": 0.5}
    sc = make_scaling_config(4, True, resources=GPU_NODE)
    assert sc.use_gpu and sc.resources_per_worker == {"CPU": 1, "GPU": 1}


def test_widget_defaults_are_the_notebook_parameters():
    picker = ScalingConfigPicker(num_workers=2, use_gpu=False, global_batch_size=64, resources=CPU_BOX)
    sc = picker.scaling_config()
    assert sc.num_workers == 2 and not sc.use_gpu
    assert picker.per_worker_batch_size == 32
    assert "32" in picker.summary.value and picker.error.value == ""


def test_widget_is_bounded_by_the_cluster_and_gpu_is_disabled_without_gpus():
    picker = ScalingConfigPicker(resources=CPU_BOX)
    assert picker.num_workers.max == 2 and picker.use_gpu.disabled and not picker.use_gpu.value
    gpu = ScalingConfigPicker(resources=GPU_NODE)
    assert not gpu.use_gpu.disabled and gpu.use_gpu.value and gpu.num_workers.value == 4
    assert gpu.scaling_config().use_gpu


def test_moving_the_controls_changes_the_config_and_the_live_text():
    picker = ScalingConfigPicker(num_workers=2, use_gpu=False, global_batch_size=64, resources=CPU_BOX)
    picker.cpus_per_worker.value = 0.5
    picker.num_workers.value = 4
    assert "64 // 4 = <b>16</b>" in picker.summary.value
    sc = picker.scaling_config()
    assert sc.num_workers == 4 and sc.resources_per_worker == {"CPU": 0.5}
    picker.global_batch_size.value = 66
    assert "does not split evenly" in picker.error.value
    with pytest.raises(ScalingError):
        picker.scaling_config()


def test_an_impossible_parameter_is_kept_and_explained_not_clamped():
    picker = ScalingConfigPicker(num_workers=8, use_gpu=False, resources=CPU_BOX)
    assert picker.num_workers.value == 8
    assert "8 workers x 1 CPU each = 8 CPUs" in picker.error.value
    with pytest.raises(ScalingError, match="at most 2 workers"):
        picker.scaling_config()
    gpu_wanted = ScalingConfigPicker(num_workers=1, use_gpu=True, resources=CPU_BOX)
    with pytest.raises(ScalingError, match="no GPUs"):
        gpu_wanted.scaling_config()


def test_widget_displays_as_an_ipywidgets_tree():
    import ipywidgets

    picker = ScalingConfigPicker(resources=CPU_BOX)
    assert isinstance(picker.widget, ipywidgets.VBox)
    assert picker.num_workers in picker.widget.children
    assert "ScalingConfigPicker(num_workers=2" in repr(picker)
