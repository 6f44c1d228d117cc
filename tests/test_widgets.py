"""The modules' controls, without a browser: what the code after each widget reads follows the controls, and an
impossible choice is refused with its reason (tests/test_browser.py drives the same widgets in JupyterLab)."""
from __future__ import annotations

import ipywidgets as w
import pandas as pd
import pytest

from coursekit.faults import FaultToleranceControls
from coursekit.planner import predict, zero_bytes
from coursekit.planner_widgets import MemoryPlanner, ZeroPicker
from coursekit.raydata import DataSplitPicker
from coursekit.scaling import ScalingError


def test_the_cpu_split_follows_the_sliders_and_refuses_a_split_that_stalls():
    split = DataSplitPicker(num_workers=2, cpus_per_worker=0.5, map_num_cpus=0.5, resources={"CPU": 2, "GPU": 0})
    assert (split.plan().data_cpus, split.plan().map_concurrency) == (1.0, 2)
    split.cpus_per_worker.value = 0.75
    assert (split.plan().cpus_per_worker, split.plan().data_cpus, split.plan().map_concurrency) == (0.75, 0.5, 1)
    assert "training 1.5 + Ray Data 0.5 of 2 CPUs" in split.summary.value
    split.cpus_per_worker.value = 1.0              # 2 x 1 CPU: nothing left for Ray Data
    assert "no task can make" in split.error.value and "no task can make" in split.problem()
    with pytest.raises(ScalingError, match="no task can make"):
        split.plan()
    split.num_workers.value = 1                    # one worker at 1 CPU leaves 1
    assert split.problem() is None and split.error.value == "" and split.plan().num_workers == 1
    split.map_num_cpus.value = 1.25                # a task bigger than what is left
    assert "1.25" in split.problem()


def test_fault_controls_give_the_plan_the_run_config_and_what_will_happen():
    c = FaultToleranceControls(epochs=4, num_workers=2)
    assert c.faults() == {"kill": {"epoch": 1, "rank": 1}, "raise": {"epoch": 2, "rank": 0}}
    assert c.run_config_args() == {"max_retries": 2, "keep": 4, "metric": "loss", "mode": "min"}
    assert c.expected() == {"failures": 2, "finishes": True, "group_starts": [0, 1, 2], "kept": 4}
    c.max_failures.value = 1                       # two failures, one allowed: the second ends the run
    assert c.expected()["finishes"] is False and "fails" in c.summary.value
    c.unlimited.value = True
    assert c.run_config_args()["max_retries"] is None and c.expected()["finishes"] and c.max_failures.disabled
    c.raise_epoch.value, c.keep.value, c.metric.value = None, 2, "accuracy"
    assert c.faults() == {"kill": {"epoch": 1, "rank": 1}}
    assert c.run_config_args() == {"max_retries": None, "keep": 2, "metric": "accuracy", "mode": "max"}
    assert "highest" in c.summary.value and c.expected()["kept"] == 2
    assert c.in_storage() == (2, 3) and "2 or 3 in storage" in c.summary.value   # the 2 best, and the latest
    c.metric.value = None                          # no score: the 2 most recent, the latest among them
    assert c.run_config_args()["metric"] is None and c.in_storage() == (2, 2) and "most recent" in c.summary.value
    c.raise_epoch.value = 1                        # both at epoch 1: one failure of the group, not two
    with pytest.raises(ValueError, match="one failure"):
        c.faults()
    assert FaultToleranceControls(epochs=3, num_workers=1).faults()["kill"]["rank"] == 0   # one worker: rank 0


def test_the_zero_picker_predicts_each_stage_and_follows_the_scaling_pickers_workers():
    workers = w.IntSlider(value=2, min=1, max=8)
    zero = ZeroPicker(num_params=1_000_000, world_size=workers, stage=3, precision="fp32")
    assert (zero.stage, zero.offload_optimizer) == (3, False)
    assert zero.prediction()["device"] == sum(zero_bytes(1_000_000, 2, 3, "fp32").values())
    workers.value = 4                               # the picker's slider moves: the prediction follows
    assert zero.world_size.value == 4 and zero.prediction()["device"] == sum(zero_bytes(1_000_000, 4, 3, "fp32").values())
    zero.stage_control.value, zero.offload_control.value = 2, True
    p = zero.prediction()
    assert p["optimizer"] == 0 and p["host"] == zero_bytes(1_000_000, 4, 2, "fp32")["optimizer"]
    assert "ZeRO-2" in zero.summary.value and "on the host" in zero.summary.value
    zero.stage_control.value = 0
    assert "stages 1, 2 and 3" in zero.error.value and zero.problem()


def test_the_memory_planner_draws_every_strategy_and_the_measurement_beside_it():
    checked = pd.DataFrame([{"strategy": "ddp", "world_size": 2, "predicted": 16e6, "measured": 16.2e6},
                            {"strategy": "zero3", "world_size": 2, "predicted": 10e6, "measured": 10.4e6}])
    planner = MemoryPlanner(num_params=300e6, world_size=8, precision="mixed", measured=checked)
    assert planner.bars() == {k: predict(300e6, 8, k, "mixed")["device"] for k in planner.bars()}
    planner.world_size.value = 16
    assert planner.bars()["zero3"] == predict(300e6, 16, "zero3", "mixed")["device"]
    assert "16 ranks" in planner.chart.value
    planner.offload.value = True                     # DDP cannot offload: no bar for it
    assert "ddp" not in planner.bars() and "fsdp2" in planner.bars()
    assert "zero3 (N=2)" in planner.measured and "measured" in planner.measured
    assert MemoryPlanner().measured is None
