"""Module 07 outside the notebook: the five comparable scripts. Their training functions run on 2 real
gloo ranks (Ray Train's context simulated, no Ray): every strategy trains like DDP on the same batches,
holds the memory the planner predicts (within 10%), the scripts fail clearly when misused, and they hold no
line of any exercise answer."""
import importlib
import subprocess
import sys

import pytest

from coursekit.distributed import run_distributed
from coursekit.planner import compare
from coursekit.testing import simulated_worker
from helpers import REPO

MODULE = REPO / "solutions" / "07_scaling_up"
SCRIPTS = ["train_single", "train_ddp_torchrun", "train_ray_ddp", "train_ray_fsdp2", "train_ray_deepspeed"]


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(MODULE))
    try:
        yield {name: importlib.import_module(name) for name in SCRIPTS}
    finally:
        sys.path.remove(str(MODULE))


def _config(scripts, **changes):
    config = scripts["train_single"].parse_args(["--smoke-test"])
    config.update({"epochs": 1, "train_samples": 384, "test_samples": 64, "measure_steps": 2, "num_workers": 2,
                   "use_gpu": False, "bf16": False, **changes})
    return config


def _run(rank, world_size, module, config):
    if not hasattr(module, "train_func"):
        return module.train(config)
    with simulated_worker(rank, world_size) as reports:
        module.train_func(config)
    return {"reports": len(reports), "checkpoints": sum(r.has_checkpoint for r in reports), **reports[-1].metrics}


@pytest.mark.slow
def test_every_strategy_trains_like_ddp_and_holds_the_predicted_memory(scripts):
    runs = {}
    for name, script, changes in [("ddp", "train_ray_ddp", {}), ("fsdp2", "train_ray_fsdp2", {}),
                                  ("zero1", "train_ray_deepspeed", {"stage": 1}),
                                  ("zero2", "train_ray_deepspeed", {"stage": 2}),
                                  ("zero3", "train_ray_deepspeed", {"stage": 3})]:
        runs[name] = run_distributed(_run, 2, scripts[script], _config(scripts, **changes), timeout_s=300)
    reference = runs["ddp"][0]["losses"]
    for name, ranks in runs.items():
        rank0 = ranks[0]
        assert abs(rank0["losses"][0] - reference[0]) < 1e-3, f"{name}: {rank0['losses']} vs DDP {reference}"
        assert rank0["world_size"] == 2 and rank0["samples_per_s"] > 0
        assert 0 <= rank0["test_accuracy"] <= 1
        assert all(r["reports"] == 1 for r in ranks), "one report per epoch from every rank"
    assert [r["checkpoints"] for r in runs["ddp"]] == [1, 0], "DDP: rank 0 checkpoints"
    for name in ("fsdp2", "zero1", "zero2", "zero3"):
        assert [r["checkpoints"] for r in runs[name]] == [1, 1], f"{name}: every rank saves its shard"
    rows = [{"strategy": name, "world_size": 2, **memory}
            for name, ranks in runs.items() for memory in ranks[0]["memory_by_rank"]]
    num_params = sum(p.numel() for p in scripts["train_single"].build_model(_config(scripts)).parameters())
    table = compare(rows, num_params, "fp32", tolerance=0.10, accumulation=False)   # the scripts: no accumulation
    assert table["within"].all(), table.to_string()


def _run_named(rank, world_size, script, config):
    """What the notebook's ranks do: import the script by name (a spawned rank does not inherit it)."""
    return _run(rank, world_size, importlib.import_module(script), config)


@pytest.mark.slow
def test_spawned_ranks_import_the_scripts_and_train_like_forked_ones(scripts, monkeypatch):
    """The notebook's road on a GPU machine (a kernel that used CUDA cannot fork): spawned ranks, which find
    the folder's scripts by name. (tests/test_notebooks.py runs the notebook with forked ranks.)"""
    config = _config(scripts)
    forked = run_distributed(_run_named, 2, "train_ray_ddp", config, timeout_s=300)
    monkeypatch.setenv("COURSE_START_METHOD", "spawn")
    spawned = run_distributed(_run_named, 2, "train_ray_ddp", config, timeout_s=300)
    assert [r["reports"] for r in spawned] == [1, 1] and [r["checkpoints"] for r in spawned] == [1, 0]
    assert spawned[0]["losses"] == pytest.approx(forked[0]["losses"], abs=1e-6)


def test_single_process_baseline(scripts):
    result = scripts["train_single"].train(_config(scripts))
    assert result["world_size"] == 1 and len(result["losses"]) == 1
    assert result["memory"]["params"] == result["memory"]["grads"]


def test_torchrun_script_explains_how_to_start_it():
    proc = subprocess.run([sys.executable, "train_ddp_torchrun.py", "--smoke-test"], cwd=MODULE,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "torchrun" in proc.stderr and "Traceback" not in proc.stderr


def test_too_few_steps_to_measure_is_a_clear_error(scripts):
    with pytest.raises(RuntimeError, match="train longer"):
        scripts["train_single"].train(_config(scripts, train_samples=128, measure_steps=8))


def test_scripts_differ_from_the_baseline_only_where_they_must():
    import difflib

    def code(name):
        lines = (MODULE / f"{name}.py").read_text().splitlines()
        return [x for x in lines if x.strip() and not x.strip().startswith("#")]

    base = code("train_single")
    for name in SCRIPTS[1:]:
        marks = [line[:2] for line in difflib.ndiff(base, code(name))]
        added, same = marks.count("+ "), marks.count("  ")
        assert added > 5, f"{name} must change something"
        assert same > len(base) / 2, f"{name} should share most of the baseline (same parsing, model, loop)"


@pytest.mark.parametrize("script", ["train_ray_ddp", "train_ray_fsdp2", "train_ray_deepspeed"])
def test_train_func_can_be_shipped_to_ray_workers(script):
    """`python train_ray_*.py` defines train_func in __main__: Ray pickles it by value, with its globals."""
    import runpy

    import ray.cloudpickle

    namespace = runpy.run_path(str(MODULE / f"{script}.py"), run_name="__ray_script__")   # main() does not run
    assert len(ray.cloudpickle.dumps(namespace["train_func"])) > 0


def test_the_scripts_hold_no_line_of_any_answer():
    """The five scripts are teaching material, released as they are and run by the notebook: no line of any
    module's exercise answer (module 07's capstone port included) may be in them (the release's own rule,
    autograder.student_release.answer_leaks, applied to this folder in solutions/ and in course/)."""
    from autograder.release import modules
    from autograder.student_release import _lines, answers

    every = {(m, gid): lines for m in modules() for _, gid, lines in answers(m)}
    for folder in (MODULE, REPO / "course" / "07_scaling_up"):
        for script in sorted(folder.glob("*.py")):
            text = _lines(script.read_text())
            hits = {f"{m}/{gid}": sorted(text & lines)[:2] for (m, gid), lines in every.items() if text & lines}
            assert not hits, f"{script.relative_to(REPO)} holds lines of answers: {hits}"
