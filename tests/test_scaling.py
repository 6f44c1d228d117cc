"""ScalingConfig checks and the widget, driven headless by setting control values."""
import pytest
from ray.train import ScalingConfig

from coursekit.scaling import ScalingConfigPicker, ScalingError, check_scaling

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


def test_possible_choices_pass_and_the_picker_never_builds_module_02s_answer():
    check_scaling(2, False, resources=CPU_BOX, global_batch_size=64)
    check_scaling(4, False, cpus_per_worker=0.5, resources=CPU_BOX)
    check_scaling(4, True, resources=GPU_NODE)
    import coursekit.scaling

    # module 02's Exercise 1 is building the ScalingConfig: the package every student has from day one does not
    assert "ScalingConfig(" not in open(coursekit.scaling.__file__).read()
    assert not hasattr(coursekit.scaling, "make_scaling_config")


def test_the_pickers_choice_builds_the_config_the_notebooks_write():
    picker = ScalingConfigPicker(num_workers=4, use_gpu=True, cpus_per_worker=2, resources=GPU_NODE)
    choice = picker.choice()
    sc = ScalingConfig(num_workers=choice["num_workers"], use_gpu=choice["use_gpu"],
                       resources_per_worker={"CPU": choice["cpus_per_worker"]})   # as 05 and 06 build it
    assert (sc.num_workers, sc.num_cpus_per_worker, sc.num_gpus_per_worker) == (4, 2, 1)


def test_widget_defaults_are_the_notebook_parameters():
    picker = ScalingConfigPicker(num_workers=2, use_gpu=False, global_batch_size=64, resources=CPU_BOX)
    assert picker.choice() == {"num_workers": 2, "use_gpu": False, "cpus_per_worker": 1.0}
    assert picker.per_worker_batch_size == 32
    assert "32" in picker.summary.value and picker.error.value == ""


def test_widget_is_bounded_by_the_cluster_and_gpu_is_disabled_without_gpus():
    picker = ScalingConfigPicker(resources=CPU_BOX)
    assert picker.num_workers.max == 2 and picker.use_gpu.disabled and not picker.use_gpu.value
    gpu = ScalingConfigPicker(resources=GPU_NODE)
    assert not gpu.use_gpu.disabled and gpu.use_gpu.value and gpu.num_workers.value == 4
    assert gpu.choice()["use_gpu"]


def test_moving_the_controls_changes_the_config_and_the_live_text():
    picker = ScalingConfigPicker(num_workers=2, use_gpu=False, global_batch_size=64, resources=CPU_BOX)
    picker.cpus_per_worker.value = 0.5
    picker.num_workers.value = 4
    assert "64 // 4 = <b>16</b>" in picker.summary.value
    assert picker.choice() == {"num_workers": 4, "use_gpu": False, "cpus_per_worker": 0.5}
    picker.global_batch_size.value = 66
    assert "does not split evenly" in picker.error.value
    with pytest.raises(ScalingError):
        picker.choice()


def test_an_impossible_parameter_is_kept_and_explained_not_clamped():
    picker = ScalingConfigPicker(num_workers=8, use_gpu=False, resources=CPU_BOX)
    assert picker.num_workers.value == 8
    assert "8 workers x 1 CPU each = 8 CPUs" in picker.error.value
    with pytest.raises(ScalingError, match="at most 2 workers"):
        picker.choice()
    gpu_wanted = ScalingConfigPicker(num_workers=1, use_gpu=True, resources=CPU_BOX)
    with pytest.raises(ScalingError, match="no GPUs"):
        gpu_wanted.choice()


def test_widget_displays_as_an_ipywidgets_tree():
    import ipywidgets

    picker = ScalingConfigPicker(resources=CPU_BOX)
    assert isinstance(picker.widget, ipywidgets.VBox)
    assert picker.num_workers in picker.widget.children
    assert "ScalingConfigPicker(num_workers=2" in repr(picker)
