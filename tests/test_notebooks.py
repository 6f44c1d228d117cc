"""Every solution notebook runs end to end with papermill at the `cpu` size (what a laptop and Binder run), and
shows learning, twice:

- as on Binder (CPU, Ray Train's local mode, no Ray where a section can do without), inside a real memory limit
  (a memory cgroup): an OOM kill or a stall fails;
- as on a laptop (a local Ray, Ray Train worker groups, Tune), for the notebooks that run Ray Train.

The peak memory (whole process tree: kernel, ranks, Ray's processes; PSS) and, on Binder, the cgroup's own peak are
written to build/notebook-runs/<module>[-laptop].json."""
import json

import pytest

from autograder.contain import memory_cgroup
from coursekit.notebooks import execute, find_notebooks
from helpers import REPO

NOTEBOOKS = find_notebooks(REPO / "solutions")
RUNS = REPO / "build" / "notebook-runs"

# Binder gives a session 2 GiB and installs the CPU build of torch. This machine (and CI) has the CUDA build, which
# costs each process that imports torch about 170 MiB more (library mappings and the heap of its static
# initialisers); a rank forked from the kernel shares the kernel's. So the limit is 2 GiB plus that much per
# process that imports torch itself, at the notebook's busiest moment (counted below, with where they come from).
BINDER_MIB = 2048
CUDA_BUILD_EXTRA_MIB = 170
TORCH_PROCESSES = {
    "01_ddp_pytorch": 5,       # the kernel; the two-node torchrun: 2 agents and 2 ranks
    "02_ray_train": 1,         # the kernel (the ranks of local mode are forks of it)
    "03_ray_data": 1,          # the kernel; Ray Data's tasks run numpy, not torch
    "04_fault_tolerance": 4,   # the kernel; torchrun's crash demo: 1 agent and 2 ranks
    "05_fsdp2": 1,
    "06_deepspeed": 1,
    "07_scaling_up": 4,        # the kernel; the torchrun launch: 1 agent and 2 ranks
}
# A notebook that stalls (a frozen kernel at the memory limit) fails at this, instead of hanging the suite.
STALL_S = 600


def check_learning(result: dict) -> None:
    assert result["returncode"] == 0, result["log_tail"]
    record = result["record"]
    losses = record["losses"]
    assert len(losses) >= 2 and losses[-1] < 0.8 * losses[0], f"the loss must fall: {losses}"
    assert record["test_accuracy"] > 0.5, f"accuracy {record['test_accuracy']} is not clearly above chance (0.1)"
    # where a notebook compares a distributed run with its single-process reference, it must agree
    if "oracle_max_difference" in record:
        assert record["oracle_max_difference"] < 1e-5
    # where a notebook streams data through Ray Data (module 03), it streamed >= 4x the object store,
    # and the store never filled up
    if "stream_data_mib" in record:
        capacity = record["stream_object_store_capacity_mib"]
        assert capacity > 0 and record["stream_data_mib"] >= 4 * capacity, record
        assert record["stream_object_store_peak_mib"] <= capacity, record


def save(name: str, figures: dict) -> None:
    RUNS.mkdir(parents=True, exist_ok=True)
    (RUNS / f"{name}.json").write_text(json.dumps(figures, indent=1))


@pytest.mark.slow
@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.parent.name)
def test_notebook_runs_and_learns_within_binders_memory(notebook, tmp_path):
    module = notebook.parent.name
    # forked gloo ranks, as on every CPU machine; the spawned ranks of a GPU machine (COURSE_START_METHOD=spawn)
    # are checked in tests/test_distributed_helpers.py and, with module 07's scripts, test_module07_scaling_up.py
    # the cpu size is what students without a GPU run (a laptop, Binder): more epochs than checkpoints kept, a
    # deeper ViT. "smoke" (CI, the grader, --smoke-test) runs the graded cells in every grading test.
    env = {"COURSE_SIZE": "cpu", "COURSE_PLATFORM": "binder"}
    limit_mib = BINDER_MIB + CUDA_BUILD_EXTRA_MIB * TORCH_PROCESSES[module]
    group = memory_cgroup(limit_mib * 2**20)
    try:
        result = execute(notebook, tmp_path / notebook.name, env=env, timeout_s=STALL_S,
                         wrap=group.enter_argv if group else None)
        oom_kills, cgroup_peak = (group.oom_kills(), group.peak()) if group else (None, None)
    finally:
        if group:
            group.remove()
    figures = {k: v for k, v in result.items() if k != "log_tail"}
    figures.update(memory_limit_mib=limit_mib if group else None, torch_processes=TORCH_PROCESSES[module],
                   cgroup_peak_mib=round(cgroup_peak / 2**20) if group else None, oom_kills=oom_kills,
                   peak_pss_less_cuda_extra_mib=result["peak_pss_mib"] - CUDA_BUILD_EXTRA_MIB * TORCH_PROCESSES[module])
    save(module, figures)
    print(f"{notebook.name}: {result['wall_s']} s, peak {result['peak_pss_mib']} MiB PSS: "
          f"{result['peak_by_process_mib']}; limit {limit_mib} MiB, cgroup peak {figures['cgroup_peak_mib']} MiB")
    assert not oom_kills, (f"{module} was OOM-killed {oom_kills} time(s) at Binder's limit ({limit_mib} MiB); at "
                           f"the peak: {result['peak_by_process_mib']}\n{result['log_tail']}")
    assert result["returncode"] != -9, f"{module} stalled: not finished in {STALL_S} s\n{result['log_tail']}"
    check_learning(result)
    if group is None:
        pytest.skip("no memory cgroup can be made on this machine: the notebook ran and learned, but Binder's "
                    "memory limit was not enforced")


@pytest.mark.slow
@pytest.mark.parametrize("notebook", [nb for nb in NOTEBOOKS if nb.parent.name != "01_ddp_pytorch"],
                         ids=lambda p: p.parent.name)   # module 01 starts no Ray: its Binder run is its laptop run
def test_notebook_runs_and_learns_on_a_laptop_with_ray(notebook, tmp_path):
    """The path of a laptop with memory to spare and of a cluster: a local Ray, Ray Train's worker groups, a 2-node
    cluster of its own losing a node under an elastic run, the driver that dies and the rerun, Tune's trials."""
    env = {"COURSE_SIZE": "cpu", "COURSE_PLATFORM": "local", "COURSE_LOCAL_MODE": "0"}
    result = execute(notebook, tmp_path / notebook.name, env=env, timeout_s=STALL_S)
    save(f"{notebook.parent.name}-laptop", {k: v for k, v in result.items() if k != "log_tail"})
    print(f"{notebook.name}: {result['wall_s']} s, peak {result['peak_pss_mib']} MiB PSS: "
          f"{result['peak_by_process_mib']}")
    check_learning(result)
    if notebook.parent.name == "04_fault_tolerance":   # the sections Binder cannot run ran here
        assert "tune_best_accuracy" in result["record"], "the Tune search ran"
        sizes = result["record"]["elastic_world_sizes"]       # the elastic run lost its worker node after epoch 1
        assert sizes[:2] == [2, 2] and set(sizes[2:]) == {1}, sizes
