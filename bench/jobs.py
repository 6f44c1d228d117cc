"""The measurements that start Ray or fork ranks, each run in its own process:

    python -m bench.jobs ray_train OUT.json [--short]   # fit cost and Ray Train DDP throughput
    python -m bench.jobs data OUT.json [--short]        # Ray Data vs DataLoader
    python -m bench.jobs memory OUT.json [--short]      # module 07's strategies (HSDP, TP, AC too) vs the planner

Ray stops when the process exits. The harness (``bench.__main__``) runs them and reads OUT.json."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from coursekit.paths import REPO  # the one repository root


# -- 2 and 3: Ray Train's fixed cost, and its DDP throughput ------------------------------------------

def trivial_train_func(config: dict) -> None:
    """The trivial train function: record when it starts and when its worker process was created, report once."""
    t_start = time.time()
    import psutil
    import ray.train

    me = psutil.Process()
    rank = ray.train.get_context().get_world_rank()
    stamps = {"t_train_func_start": t_start, "t_worker_process_created": me.create_time(), "rank": rank,
              "t_controller_process_created": _controller_created(me)}
    stamps["t_report"] = time.time()
    ray.train.report(stamps)
    # Ray Train V2 keeps metrics in Result only with a checkpoint: the stamps go to a file (same machine)
    Path(config["stamps"], f"rank{rank}.json").write_text(json.dumps(stamps))


def _controller_created(me) -> float | None:
    """When the newest Ray Train controller process (``ray::TrainController``) on this machine was created."""
    import psutil

    times = []
    for p in psutil.process_iter(["cmdline", "create_time"]):
        cmd = p.info["cmdline"] or []
        if cmd and cmd[0].startswith("ray::TrainController") and p.info["create_time"] <= me.create_time() + 1:
            times.append(p.info["create_time"])
    return max(times) if times else None


def _import_seconds(code: str) -> float:
    """What a fresh Python process needs for ``code`` (imports a new Ray process pays)."""
    import subprocess

    t0 = time.time()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.time() - t0


def _stamps(folder: Path) -> dict:
    """Rank 0's file, and the latest of every rank's start."""
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    out = next(r for r in ranks if r["rank"] == 0)
    out["t_train_func_start_last_rank"] = max(r["t_train_func_start"] for r in ranks)
    return out


def _fit(train_func, config: dict, name: str):
    import ray.train
    from ray.train.torch import TorchTrainer

    from coursekit.raysetup import storage_path

    trainer = TorchTrainer(train_func, train_loop_config=config,
                           scaling_config=ray.train.ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=ray.train.RunConfig(storage_path=storage_path(), name=_run_name(name)))
    t0 = time.time()
    result = trainer.fit()
    t1 = time.time()
    return t0, t1, result


def _run_name(name: str) -> str:
    return f"bench-{name}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6:06d}"


# What Ray Train's controller logs (DEBUG and INFO, JSON lines in the session's logs/train folder) at each
# step of starting a worker group: the first line that starts with each text, and its step's name.
CONTROLLER_STEPS = {"t_controller_ready": "Attempting to start training worker group",
                    "t_worker_actors_ready": "[Worker Group Initialization] 2 worker actors created",
                    "t_train_context_ready": "[Worker Group Initialization] Train context initialized",
                    "t_train_func_launched": "[Worker Group Initialization] Train function launched",
                    "t_shutdown": "Shutting down"}


def _controller_log_times(run_name: str, since: float) -> dict:
    """When the controller of run ``run_name`` logged each of CONTROLLER_STEPS (wall-clock seconds); {} if its
    log is not found. Every Ray session on the machine is searched: other programs' Rays start sessions too,
    so the newest session need not be ours."""
    import glob
    import os

    root = os.environ.get("RAY_TMPDIR", "/tmp/ray")
    out: dict = {}
    for path in glob.glob(f"{root}/session_*/logs/train/ray-train-sys-controller-*.log"):
        try:
            if os.path.getmtime(path) < since:
                continue
            with open(path) as f:
                records = [json.loads(line) for line in f if run_name in line]
        except (OSError, ValueError):
            continue
        for r in records:
            for key, text in CONTROLLER_STEPS.items():
                if key not in out and r.get("run_name") == run_name and r.get("message", "").startswith(text):
                    out[key] = r["timestamp_ns"] / 1e9
    return out


def ray_train(short: bool) -> dict:
    import coursekit
    from coursekit.raysetup import init_ray

    rt = coursekit.detect()
    out: dict = {"runtime": rt.describe()}
    if not short:   # two fresh interpreters: what a Ray Train worker and its controller import
        out["fresh_process_import_torch_and_ray_train_s"] = _import_seconds("import torch.distributed, ray.train.torch")
        out["fresh_process_import_train_controller_s"] = _import_seconds(
            "from ray.train.v2._internal.execution.controller.controller import TrainController")
    t0 = time.time()
    init_ray(rt)
    out["ray_init_s"] = time.time() - t0

    # a worker process's own start-up: two plain 1-CPU actors, created and answering once
    import ray

    @ray.remote(num_cpus=1)
    class Ping:
        def created(self):
            import psutil

            return psutil.Process().create_time()

    t0 = time.time()
    actors = [Ping.remote() for _ in range(2)]
    created = ray.get([a.created.remote() for a in actors])
    out["two_plain_actors_s"] = time.time() - t0
    out["plain_actor_process_created_after_s"] = max(created) - t0
    for a in actors:
        ray.kill(a)
    # the same with a runtime_env of their own (Ray Train's worker actors have one: the env vars it propagates),
    # which a prestarted idle worker process cannot serve
    t0 = time.time()
    actors = [Ping.options(runtime_env={"env_vars": {"BENCH_PROBE": "1"}}).remote() for _ in range(2)]
    created = ray.get([a.created.remote() for a in actors])
    out["two_actors_own_runtime_env_s"] = time.time() - t0
    out["own_runtime_env_actor_process_created_after_s"] = max(created) - t0
    for a in actors:
        ray.kill(a)
    time.sleep(1.0)

    fits = []
    for _ in range(1 if short else 3):
        folder = Path(tempfile.mkdtemp(prefix="bench-fit-"))
        t_call, t_return, result = _fit(trivial_train_func, {"stamps": str(folder)}, "fit-cost")
        m = _stamps(folder)
        controller = m.get("t_controller_process_created")
        logged = _controller_log_times(Path(result.path).name, t_call)

        def between(a, b):
            return None if a is None or b is None else b - a

        fits.append({"fit_s": t_return - t_call,
                     # the finer split: the controller's own log lines between the stamps
                     "controller_process_to_ready_s": between(controller, logged.get("t_controller_ready")),
                     "controller_ready_to_worker_process_created_s": between(logged.get("t_controller_ready"),
                                                                             m["t_worker_process_created"]),
                     "worker_process_to_actor_ready_s": between(m["t_worker_process_created"],
                                                                logged.get("t_worker_actors_ready")),
                     "actor_ready_to_train_context_s": between(logged.get("t_worker_actors_ready"),
                                                               logged.get("t_train_context_ready")),
                     "train_context_to_train_func_s": between(logged.get("t_train_context_ready"),
                                                              m["t_train_func_start"]),
                     "report_to_shutdown_s": between(m["t_report"], logged.get("t_shutdown")),
                     "shutdown_to_fit_return_s": between(logged.get("t_shutdown"), t_return),
                     "until_controller_process_created_s": None if controller is None else controller - t_call,
                     "controller_to_worker_process_created_s": None if controller is None else
                     m["t_worker_process_created"] - controller,
                     "until_worker_process_created_s": m["t_worker_process_created"] - t_call,
                     "worker_process_to_train_func_s": m["t_train_func_start"] - m["t_worker_process_created"],
                     "until_train_func_start_s": m["t_train_func_start"] - t_call,
                     "until_last_rank_train_func_start_s": m["t_train_func_start_last_rank"] - t_call,
                     "train_func_s": m["t_report"] - m["t_train_func_start"],
                     "report_to_fit_return_s": t_return - m["t_report"]})
    out["fits"] = fits

    from bench.ddp_loop import config_for, ray_train_func

    steps, warmup = (5, 2) if short else (40, 5)
    folder = Path(tempfile.mkdtemp(prefix="bench-throughput-"))
    t_call, t_return, result = _fit(ray_train_func, {**config_for(steps, warmup), "stamps": str(folder)}, "throughput")
    m = _stamps(folder)
    out["throughput"] = {**m, "fit_s": t_return - t_call, "until_train_func_start_s": m["t_train_func_start"] - t_call}
    return out


# -- 4: Ray Data against a DataLoader, module 03's preprocessing ------------------------------------

def preprocess(batch: dict) -> dict:
    """Module 03's preprocess (the notebook's reference answer): uint8 [B, 28, 28] -> float32 [B, 1, 28, 28]."""
    import numpy as np

    images = np.asarray(batch["image"], dtype=np.float32) / 255.0
    images = (images - 0.5) / 0.5
    return {"image": images[:, None, :, :].astype(np.float32), "label": np.asarray(batch["label"]).astype(np.int64)}


def label_from_path(batch: dict) -> dict:
    import numpy as np

    batch["label"] = np.array([int(Path(p).parent.name) for p in batch["path"]], dtype=np.int64)
    del batch["path"]
    return batch


class PngFolder:
    """torchvision-style image folder, as in module 03: (uint8 image, label) per PNG file."""

    def __init__(self, root):
        from coursekit.data import require_files

        self.files = require_files(root, "*.png", "PNG images")

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        import numpy as np
        from PIL import Image

        return np.asarray(Image.open(self.files[i]).convert("L")), int(self.files[i].parent.name)


def collate_preprocessed(items):
    import numpy as np
    import torch

    images, labels = zip(*items)
    out = preprocess({"image": np.stack(images), "label": np.array(labels)})
    return {k: torch.from_numpy(v) for k, v in out.items()}


def data(short: bool) -> dict:
    """Module 03's comparison (its notebook's cell "DataLoader vs Ray Data"): the same PNG folder, read,
    decoded, preprocessed and batched by a DataLoader with the CPUs Ray Data gets, and by Ray Data."""
    import ray
    import ray.data
    from torch.utils.data import DataLoader

    import coursekit
    from coursekit.data import load_digits, write_digits_image_folder
    from coursekit.raydata import configure_ray_data, local_ray_options, plan_resources, timed
    from coursekit.raysetup import init_ray

    rt = coursekit.detect()
    n_rows = 512 if short else 2048
    batch_size = rt.sizes["global_batch_size"]
    digits = load_digits(train=True, limit=n_rows, quiet=True)
    out: dict = {"runtime": rt.describe(), "rows": len(digits), "source": digits.source, "batch_size": batch_size}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        images_dir = str(write_digits_image_folder(digits, Path(tmp) / "images"))
        init_ray(rt, **local_ray_options(80))                      # as module 03 does locally
        resources = {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU")}
        plan = plan_resources(2, rt.num_cpus / 2 / 2, False, 0.5, resources=resources)   # module 03's plan
        configure_ray_data(plan)
        out["plan"] = plan.describe()
        loader_workers = max(1, int(plan.data_cpus))
        passes = []
        for i in range(1 if short else 2):   # the first pass includes starting the loader's / Ray's processes
            loader = DataLoader(PngFolder(images_dir), batch_size=batch_size, num_workers=loader_workers,
                                collate_fn=collate_preprocessed)
            t0 = time.perf_counter()
            n_batches, _ = timed(loader)
            dataloader_s = time.perf_counter() - t0
            pipeline = (ray.data.read_images(images_dir, mode="L", include_paths=True, num_cpus=plan.map_num_cpus)
                        .map_batches(label_from_path)
                        .map_batches(preprocess, batch_format="numpy", num_cpus=plan.map_num_cpus,
                                     compute=ray.data.TaskPoolStrategy(size=plan.map_concurrency)))
            t0 = time.perf_counter()
            n_batches_ray, _ = timed(pipeline.iter_torch_batches(batch_size=batch_size))
            raydata_s = time.perf_counter() - t0
            passes.append({"pass": i + 1, "dataloader_s": dataloader_s, "raydata_s": raydata_s,
                           "dataloader_rows_per_s": len(digits) / dataloader_s,
                           "raydata_rows_per_s": len(digits) / raydata_s,
                           "batches": [n_batches, n_batches_ray], "dataloader_workers": loader_workers})
        out["passes"] = passes
    return out


# -- 6: per-rank memory of module 07's strategies against the planner --------------------------------

def _run_script(rank, world_size, module, config):
    from coursekit.testing import simulated_worker

    with simulated_worker(rank, world_size) as reports:
        module.train_func(config)
    return reports[-1].metrics


def _run_scripts(rank, world_size, module, configs: dict):
    return {name: _run_script(rank, world_size, module, config) for name, config in configs.items()}


def memory(short: bool) -> dict:
    """Module 07's training functions on real gloo ranks (Ray Train's context simulated, as
    tests/test_module07_scaling_up.py runs them): DDP, FSDP2 (with and without activation checkpointing) and
    ZeRO on 2 ranks, HSDP and TP x FSDP2 on 2 nodes x 2; the model-state bytes their StepMeter counts per rank,
    and the FSDP2 script's activations, against coursekit.planner via compare()."""
    import importlib

    from coursekit.distributed import run_distributed
    from coursekit.planner import compare, vit_parameters

    folder = REPO / "solutions" / "07_scaling_up"
    sys.path.insert(0, str(folder))
    single = importlib.import_module("train_single")
    base = single.parse_args(["--smoke-test"])
    base.update({"epochs": 1, "train_samples": 384, "test_samples": 64, "measure_steps": 2, "num_workers": 2,
                 "use_gpu": False, "bf16": False})
    vit = vit_parameters(**base["vit"])
    # (name, script, world size, config changes, the planner's strategy and options)
    plan = [("fsdp2", "train_ray_fsdp2", 2, {}, {"strategy": "fsdp2"})] if short else [
        ("ddp", "train_ray_ddp", 2, {}, {"strategy": "ddp"}),
        ("fsdp2", "train_ray_fsdp2", 2, {}, {"strategy": "fsdp2"}),
        ("fsdp2 + AC", "train_ray_fsdp2", 2, {"checkpointing": True}, {"strategy": "fsdp2", "checkpointing": True}),
        ("zero1", "train_ray_deepspeed", 2, {"stage": 1}, {"strategy": "zero1"}),
        ("zero2", "train_ray_deepspeed", 2, {"stage": 2}, {"strategy": "zero2"}),
        ("zero3", "train_ray_deepspeed", 2, {"stage": 3}, {"strategy": "zero3"}),
        ("hsdp", "train_ray_fsdp2", 4, {"hsdp": 2}, {"strategy": "hsdp", "ranks_per_node": 2}),
        ("tp x fsdp2", "train_ray_fsdp2", 4, {"tp": 2}, {"strategy": "tp_fsdp", "tp": 2, "tp_params": vit["tp"]}),
        ("tp x fsdp2 + AC", "train_ray_fsdp2", 4, {"tp": 2, "checkpointing": True},
         {"strategy": "tp_fsdp", "tp": 2, "tp_params": vit["tp"], "checkpointing": True})]
    rows, seconds, throughput = [], {}, {}
    for world_size, script in sorted({(n, script) for _, script, n, _, _ in plan}):
        runs = [entry for entry in plan if entry[1] == script and entry[2] == world_size]
        t0 = time.perf_counter()
        ranks = run_distributed(_run_scripts, world_size, importlib.import_module(script),
                                {name: {**base, **changes} for name, _, _, changes, _ in runs}, timeout_s=600)
        for name, _, _, _, planner in runs:
            seconds[name] = (time.perf_counter() - t0) / len(runs)
            throughput[name] = ranks[0][name]["samples_per_s"]
            rows += [{"name": name, "world_size": world_size, "rank": r, **planner, **mem}
                     for r, mem in enumerate(ranks[0][name]["memory_by_rank"])]
    table = compare(rows, vit["total"], "fp32", tolerance=0.10, accumulation=False, vit=base["vit"])
    return {"num_params": vit["total"], "precision": "fp32", "world_size": 2, "by_rank": rows,
            "comparison": json.loads(table.to_json(orient="records")), "seconds": seconds,
            "samples_per_s": throughput, "vit": base["vit"], "batch": base["global_batch_size"]}


JOBS = {"ray_train": ray_train, "data": data, "memory": memory}

if __name__ == "__main__":
    job, out_path = sys.argv[1], sys.argv[2]
    result = JOBS[job]("--short" in sys.argv[3:])
    Path(out_path).write_text(json.dumps(result, indent=1, default=str))
