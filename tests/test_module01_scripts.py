"""Module 01 (vanilla PyTorch DDP): the torchrun script, the multi-node launcher, the notebook source.

The slow tests really launch ``torchrun`` (2 gloo processes on CPU, smoke sizes)
and check that the job learns; the fast ones check argument handling, and that the
exercises the script imports (``ddp_exercises.py``) hold the notebook's answers in
solutions/ and only stubs in the release.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from helpers import REPO
import torch

from autograder.release import strip_script
from coursekit.distributed import free_port
from coursekit.models import build_resnet18

MODULE_DIR = REPO / "solutions" / "01_ddp_pytorch"
TRAIN = MODULE_DIR / "train_ddp.py"
EXERCISES = MODULE_DIR / "ddp_exercises.py"
NOTEBOOK = MODULE_DIR / "01_ddp_pytorch.ipynb"
EXERCISE_NAMES = ("sharded_epochs", "train_step", "save_checkpoint")
LAUNCH = MODULE_DIR / "launch_multinode_ddp.sh"
TIMEOUT_S = 420


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}}
    env.update(COURSE_SIZE="smoke", COURSE_DATA=str(tmp_path / "data"),
               COURSE_STORAGE=str(tmp_path / "storage"), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _torchrun(*args: str) -> list[str]:
    # `python -m torch.distributed.run` is `torchrun`, from the interpreter running the tests
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _check_learned(metrics_path: Path, world_size: int) -> dict:
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["losses"]
    assert metrics["world_size"] == world_size
    assert len(losses) == metrics["epochs"] >= 2
    assert losses[-1] < losses[0], f"the loss did not fall: {losses}"
    assert metrics["test_accuracy"] > 0.5, f"accuracy {metrics['test_accuracy']} is not far above chance"
    return metrics


def _check_checkpoint(ckpt_dir: Path, epochs: int) -> None:
    files = sorted(p.name for p in ckpt_dir.iterdir())
    assert files == ["checkpoint.pt"], f"rank 0 alone writes one checkpoint; found {files}"
    ckpt = torch.load(ckpt_dir / "checkpoint.pt", map_location="cpu")
    assert set(ckpt) == {"model", "optimizer", "epoch"}
    assert ckpt["epoch"] == epochs - 1
    assert not any(k.startswith("module.") for k in ckpt["model"])
    build_resnet18().load_state_dict(ckpt["model"])  # loads into a plain, unwrapped model


# ---------------------------------------------------------------------------------------- fast
def test_non_divisible_global_batch_fails_fast(tmp_path):
    """Checked before joining the process group: one rank started by hand is enough."""
    env = _env(tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, str(TRAIN), "--smoke-test", "--global-batch-size", "63"],
                          cwd=MODULE_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--global-batch-size 63 is not divisible by the world size 2" in proc.stderr, proc.stderr
    assert "62 or 64" in proc.stderr


def _solution_regions(text: str) -> list[str]:
    regions = [r.split("### END SOLUTION", 1)[0] for r in text.split("### BEGIN SOLUTION")[1:]]
    return [textwrap.dedent(r).strip() for r in regions]


def test_script_exercises_are_the_notebook_answers():
    """ddp_exercises.py (imported by train_ddp.py) holds the same answers as the notebook's exercise cells."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    cells = {c.metadata["nbgrader"]["grade_id"]: c.source for c in nb.cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    script = EXERCISES.read_text()
    assert _solution_regions(script) == [_solution_regions(cells[name])[0] for name in EXERCISE_NAMES]
    for name in EXERCISE_NAMES:
        assert f"def {name}(" in script and f"def {name}(" in cells[name]


def test_released_exercises_are_stubs(tmp_path):
    """In the release each exercise of ddp_exercises.py raises NotImplementedError, and no answer line remains."""
    released = strip_script(EXERCISES.read_text())
    answers = {ln.strip() for r in _solution_regions(EXERCISES.read_text()) for ln in r.splitlines()
               if len(ln.strip()) > 20}
    assert not answers & {ln.strip() for ln in released.splitlines()}
    assert not answers & {ln.strip() for ln in TRAIN.read_text().splitlines()}, "train_ddp.py holds an answer"
    namespace: dict = {}
    exec(compile(released, "ddp_exercises.py", "exec"), namespace)
    calls = {"sharded_epochs": ([], 2, 1), "train_step": (None, None, None, None),
             "save_checkpoint": (None, None, 0, tmp_path / "x.pt")}
    for name, args in calls.items():
        with pytest.raises(NotImplementedError):
            result = namespace[name](*args)
            next(iter(result)) if name == "sharded_epochs" else None


def test_missing_exercises_file_fails_fast(tmp_path):
    env = _env(tmp_path, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2")
    proc = subprocess.run([sys.executable, str(TRAIN), "--smoke-test", "--exercises", str(tmp_path / "nope.py")],
                          cwd=MODULE_DIR, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no such file" in proc.stderr, proc.stderr


@pytest.mark.parametrize("missing", ["NODE_RANK", "MASTER_ADDR"])
def test_launcher_requires_node_rank_and_master_addr(tmp_path, missing):
    settings = {"NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "NPROC_PER_NODE": "1", "PYTHON": sys.executable}
    del settings[missing]
    proc = subprocess.run(["bash", str(LAUNCH), "--smoke-test"], cwd=MODULE_DIR, env=_env(tmp_path, **settings),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"set {missing}" in proc.stderr, proc.stderr


def test_launcher_rejects_node_rank_out_of_range(tmp_path):
    env = _env(tmp_path, NODE_RANK="2", NNODES="2", MASTER_ADDR="127.0.0.1", NPROC_PER_NODE="1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(LAUNCH)], cwd=MODULE_DIR, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "NODE_RANK=2" in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_torchrun_single_node_learns_and_checkpoints_once(tmp_path):
    ckpt_dir, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    proc = subprocess.run(
        _torchrun("--standalone", "--nproc_per_node=2", "train_ddp.py", "--smoke-test",
                  "--checkpoint-dir", str(ckpt_dir), "--metrics-out", str(metrics)),
        cwd=MODULE_DIR, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("epoch 1/") == 1, "only rank 0 should print the epoch loss"
    m = _check_learned(metrics, world_size=2)
    assert m["per_worker_batch_size"] * 2 == m["global_batch_size"]
    _check_checkpoint(ckpt_dir, m["epochs"])


@pytest.mark.slow
def test_multinode_launcher_two_node_ranks_on_localhost(tmp_path):
    ckpt_dir, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    common = dict(NNODES="2", NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                  PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    # the exercises from a file elsewhere, passed through the launcher, as the notebook does with yours
    exercises = shutil.copy(EXERCISES, tmp_path / "my_exercises.py")
    args = ["bash", str(LAUNCH), "--smoke-test", "--checkpoint-dir", str(ckpt_dir), "--metrics-out", str(metrics),
            "--exercises", str(exercises)]
    procs, logs = [], []
    try:
        for node_rank in range(2):
            log = open(tmp_path / f"node{node_rank}.log", "w+")
            logs.append(log)
            procs.append(subprocess.Popen(args, cwd=MODULE_DIR, env=_env(tmp_path, NODE_RANK=str(node_rank), **common),
                                          stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [(tmp_path / f"node{r}.log").read_text() for r in range(2)]
    for log in logs:
        log.close()
    assert codes == [0, 0], "\n\n".join(o[-3000:] for o in outputs)
    assert "world size 2" in outputs[1] and "test accuracy" in outputs[0]
    _check_learned(metrics, world_size=2)
    _check_checkpoint(ckpt_dir, json.loads(metrics.read_text())["epochs"])


@pytest.mark.slow
def test_torchrun_reports_a_non_divisible_global_batch(tmp_path):
    proc = subprocess.run(
        _torchrun("--standalone", "--nproc_per_node=2", "train_ddp.py", "--smoke-test", "--global-batch-size", "63",
                  "--checkpoint-dir", str(tmp_path / "ckpt")),
        cwd=MODULE_DIR, env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode != 0
    assert "is not divisible by the world size 2" in proc.stdout + proc.stderr
    assert not (tmp_path / "ckpt").exists(), "nothing may be written when the arguments are wrong"


def test_the_visible_checks_sampler_order_is_torchs_distributedsampler():
    """coursekit.exercise_checks.ddp.sampler_order follows torch's rule without calling the sampler (the released
    checks must not hold exercise 1's calls): it gives what DistributedSampler gives after set_epoch, padding
    included, for sizes that do and do not divide evenly."""
    from torch.utils.data.distributed import DistributedSampler

    from coursekit.exercise_checks.ddp import sampler_order

    for n, world_size, epoch, seed in [(16, 2, 0, 0), (10, 4, 3, 7), (3, 4, 1, 5), (1, 3, 0, 2), (37, 8, 2, 0)]:
        for rank in range(world_size):
            sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            sampler.set_epoch(epoch)
            assert sampler_order(rank, world_size, n, epoch, seed) == list(sampler), (n, world_size, epoch, seed, rank)
