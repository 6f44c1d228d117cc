"""Module 07's check runs: your ``train_func``, handed in as an argument, run on forked CPU ranks the way Ray Train's
workers would run it, watched from outside your code. Each returns plain data for the test cells to show, check
(``coursekit.exercise_checks.capstone``) and hand in (``coursekit.evidence``); the grader computes its own
references and verdicts outside your kernel.

- ``RankProbe`` watches a rank through PyTorch's global hooks (every module's forward, every optimizer's step), so it
  sees your model and optimizer whatever you call them;
- ``CollectiveGuard`` stands between your code and DCP's ``save``/``load`` (collectives: every rank must call them):
  a call that the other ranks do not join within ``GUARD_WAIT_S`` seconds is recorded (and a save skipped) instead
  of waiting forever, as it would on a cluster;
- ``device_rule`` makes the CPU behave as on a GPU worker, where the CPU is not the worker's device, for what
  ``train_func`` computes;
- ``run_port`` runs ``train_func`` on N ranks under all three (a resumed run gets its checkpoint on a pyarrow
  filesystem of its own, as from S3); ``one_process`` runs the colleague's script on the same config; ``describe``
  turns a run into the plain data a test cell hands in.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import pyarrow.fs
import ray
import ray.train
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from ray.train import Checkpoint
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

import coursekit
import coursekit.data
from coursekit.distributed import run_distributed
from coursekit.memory import PeakTensorBytes, rank_bytes, tensor_bytes
from coursekit.testing import simulated_worker

GUARD_WAIT_S = 10      # how long a rank waits for the others at a DCP call before the call counts as its alone


class RankProbe:
    """Watches one rank's training from outside your code: how far its live tensors rose before the model's first
    forward pass (the construction), the DigitNet whose forward runs, what the rank holds at its second optimizer
    step (gradients alive, AdamW's state made by the first), and the most layers that held full (gathered, not
    DTensor) weights at one moment while the model computed."""

    def __init__(self, model_class: type):
        self.model_class = model_class           # the script's DigitNet: its forward marks the end of construction
        self.model, self.steps, self.memory, self.optimizer_holds_model = None, 0, None, None
        self.layers_gathered: list = []
        self.construction, self.construction_peak = None, None
        self.allocated_before_sharding, self.to_empty_devices = 0, []

    def sharding(self) -> list:
        """Swaps that note, as your code shards and allocates, the values fully_shard meets already allocated (not
        on the meta device, not yet sharded) and the device each to_empty call names."""
        import torch.distributed.fsdp as fsdp

        real_shard, real_to_empty, probe = fsdp.fully_shard, nn.Module.to_empty, self

        def fully_shard(module, *args, **kwargs):
            probe.allocated_before_sharding += sum(p.numel() for p in module.parameters()
                                                   if not isinstance(p, DTensor) and p.device.type != "meta")
            return real_shard(module, *args, **kwargs)

        def to_empty(module, *, device, recurse=True):
            probe.to_empty_devices.append(None if device is None else str(torch.device(device)))
            return real_to_empty(module, device=device, recurse=recurse)
        return [(fsdp, "fully_shard", fully_shard), (nn.Module, "to_empty", to_empty)]

    def construction_ends(self):
        if self.construction is not None:
            self.construction.__exit__(None, None, None)
            self.construction_peak, self.construction = self.construction.bytes, None

    def before_forward(self, module, _inputs):
        if isinstance(module, self.model_class):
            self.construction_ends()
            self.model = module
        elif self.model is not None and isinstance(module, nn.Linear):      # some part of the model computes
            gathered = [i for i, layer in enumerate(self.model.layers)
                        if any(not isinstance(p, DTensor) for p in layer.parameters())]
            if len(gathered) > len(self.layers_gathered):
                self.layers_gathered = gathered

    def before_step(self, optimizer, _args, _kwargs):
        self.steps += 1
        if self.steps == 2 and self.model is not None:
            mine = {id(p) for p in self.model.parameters()}
            held = [p for group in optimizer.param_groups for p in group["params"]]
            self.optimizer_holds_model = {id(p) for p in held} == mine
            self.memory = rank_bytes(self.model, optimizer)
            self.memory["params"] += sum(tensor_bytes(p) for p in held if id(p) not in mine)   # only the optimizer's

    @contextlib.contextmanager
    def watching(self):
        hooks = [register_module_forward_pre_hook(self.before_forward),
                 register_optimizer_step_pre_hook(self.before_step)]
        self.construction = PeakTensorBytes().__enter__()    # until the first forward pass
        try:
            yield self
        finally:
            if self.construction is not None:                # no forward pass: no construction peak either
                self.construction.__exit__(None, None, None)
                self.construction = None
            for hook in hooks:
                hook.remove()

    def facts(self) -> dict:
        params = list(self.model.parameters()) if self.model is not None else []
        return {"memory": self.memory, "optimizer_holds_model": self.optimizer_holds_model,
                "construction_peak": self.construction_peak,
                "allocated_before_sharding": self.allocated_before_sharding, "to_empty_devices": self.to_empty_devices,
                "layers": len(self.model.layers) if self.model is not None else 0,
                "layers_gathered": self.layers_gathered,
                "meshes": sorted({(p.device_mesh.device_type, p.device_mesh.size()) for p in params
                                  if isinstance(p, DTensor)}),
                "unsharded": [n for n, p in self.model.named_parameters() if not isinstance(p, DTensor)]
                if self.model is not None else []}

    def full_weights(self):
        """The model's whole weights (DTensor shards gathered: a collective, every rank calls it)."""
        return {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
                for name, p in self.model.named_parameters()}


class CollectiveGuard:
    """DCP's save and load are collectives: on a cluster, one rank calling them alone waits forever. Here such a call
    is recorded after GUARD_WAIT_S seconds: an alone save is skipped, an alone load (or full state dict) raises."""

    def __init__(self, folder: str, rank: int, world_size: int):
        self.folder, self.rank, self.world_size, self.alone = folder, rank, world_size, []

    def wrap(self, name: str, function, skip_alone: bool, only_if=lambda *a, **k: True):
        calls = itertools.count()

        def guarded(*args, **kwargs):
            if not only_if(*args, **kwargs):
                return function(*args, **kwargs)
            mark = os.path.join(self.folder, f"{name}-{next(calls)}-")
            Path(f"{mark}{self.rank}").touch()
            deadline = time.monotonic() + (0 if self.alone else GUARD_WAIT_S)
            while True:
                arrived = [r for r in range(self.world_size) if os.path.exists(f"{mark}{r}")]
                if len(arrived) == self.world_size:
                    return function(*args, **kwargs)
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            missing = sorted(set(range(self.world_size)) - set(arrived))
            self.alone.append(f"rank {self.rank} called {name} and ranks {missing} did not (within {GUARD_WAIT_S} s): "
                              f"it is a collective, every rank calls it with its own shards (on a cluster, rank "
                              f"{self.rank} would wait for them forever)")
            if skip_alone:
                return None
            raise AssertionError(self.alone[-1])
        return guarded

    @contextlib.contextmanager
    def installed(self, namespace: dict, checkpoint):
        import torch.distributed.checkpoint.state_dict as dcp_state

        def gathers(*args, **kwargs):   # a full state dict: every rank must take part in gathering it
            options = kwargs.get("options") or next((a for a in args if isinstance(a, StateDictOptions)), None)
            return bool(options and options.full_state_dict)

        swaps = [(dcp, "save", self.wrap("dcp.save", dcp.save, skip_alone=True)),
                 (dcp, "load", self.wrap("dcp.load", dcp.load, skip_alone=False)),
                 (ray.train, "get_checkpoint", lambda: checkpoint)]
        swaps += [(dcp_state, name, self.wrap(name, getattr(dcp_state, name), skip_alone=False, only_if=gathers))
                  for name in ("get_state_dict", "get_model_state_dict", "get_optimizer_state_dict")]
        with swapped(namespace, swaps):
            yield self


@contextlib.contextmanager
def swapped(namespace: dict, swaps: list):
    """Each (owner, name, new) set in its module, and in `namespace` any name your code bound to the same object;
    all put back on exit."""
    replaced = []
    for owner, name, new in swaps:
        old = getattr(owner, name)
        replaced.append((owner, name, old))
        setattr(owner, name, new)
        replaced += [(namespace, key, value) for key, value in list(namespace.items()) if value is old]
        namespace.update({key: new for key, value in namespace.items() if value is old})
    try:
        yield
    finally:
        for owner, name, old in reversed(replaced):
            if isinstance(owner, dict):
                owner[name] = old
            else:
                setattr(owner, name, old)


class PreloadedDigits(coursekit.data.Digits):
    """A data set whose float tensors were made in advance: .tensors and .dataset() allocate nothing."""

    @property
    def tensors(self) -> torch.Tensor:
        return self.made


def preloaded_data(config: dict) -> list:
    """The swap that hands train_func the check's data set loaded before it starts (its tensors are then not counted
    in the construction peak): load_digits(train=True, limit=config["train_samples"]) returns it; other calls run."""
    real = coursekit.data.load_digits
    digits = PreloadedDigits(**vars(real(train=True, limit=config["train_samples"], quiet=True)))
    digits.made = coursekit.data.normalize(digits.images)

    def load_digits_preloaded(*args, **kwargs):
        bound = inspect.signature(real).bind(*args, **kwargs)
        bound.apply_defaults()
        same = bound.arguments["train"] is True and bound.arguments["limit"] == config["train_samples"]
        return digits if same else real(*args, **kwargs)
    return [(coursekit.data, "load_digits", load_digits_preloaded)]


class device_rule(torch.overrides.TorchFunctionMode):
    """As on a GPU worker, where the CPU is not the worker's device, for what `code` (train_func) computes: a tensor
    made there by torch.zeros/ones/full/empty/tensor without device=, or a batch as the DataLoader yields it, is on
    the CPU; an operation of train_func that mixes it with the worker's tensors, or an all_reduce of it (NCCL reduces
    GPU tensors only), raises here as it does there. (The workers' device is the CPU here too: nothing else would
    tell. FSDP2 moves the model's inputs to its device itself.)"""
    FACTORIES = {"zeros", "ones", "full", "empty", "tensor"}
    MOVES = {"to", "cuda", "cpu", "__get__", "__set__", "__repr__", "__format__", "item", "tolist", "numpy"}
    LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, ray, coursekit, contextlib))

    def __init__(self, code):
        super().__init__()
        self.code = code

    def _caller(self):
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(self.LIBRARIES):
            frame = frame.f_back
        return frame

    @staticmethod
    def on_cpu(t):
        return isinstance(t, torch.Tensor) and t.dim() > 0 and t.__dict__.get("_on_the_cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        out = func(*args, **kwargs)
        if name in ("to", "cuda") and self.on_cpu(out) and out is args[0] and (   # moved to a device (the worker's
                name == "cuda" or torch._C._nn._parse_to(*args[1:], **kwargs)[0] is not None):   # is the CPU here):
            return out.view_as(out)                                  # a new tensor, as on a GPU worker, unmarked
        if name in self.MOVES or (name.startswith("_") and not name.startswith("__")):
            return out
        frame = self._caller()
        if frame is None or frame.f_code is not self.code:
            return out
        line = f"line {frame.f_lineno - self.code.co_firstlineno + 1} of train_func"
        if name in self.FACTORIES:
            if kwargs.get("device") is None and isinstance(out, torch.Tensor):
                out.__dict__["_on_the_cpu"] = f"{line} (made without device=)"
            return out
        given = [t for x in (*args, *kwargs.values()) for t in (x if isinstance(x, (list, tuple)) else [x])
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
        cpu = [self.on_cpu(t) for t in given if self.on_cpu(t)]
        if cpu and len(cpu) < len(given):
            raise RuntimeError(f"Expected all tensors to be on the same device: at {line}, {name} mixes a tensor on "
                               f"the CPU ({cpu[0]}) with the worker's (on a GPU worker: cpu and cuda:N). Keep what "
                               "you compute on ray.train.torch.get_device(): make tensors with device=, move batches "
                               "with .to(device)")
        if cpu and isinstance(out, torch.Tensor) and out.dim() > 0:
            out.__dict__["_on_the_cpu"] = cpu[0]
        return out

    def __enter__(self):
        rule, real_iter, real_all_reduce = self, torch.utils.data.DataLoader.__iter__, dist.all_reduce

        def batches(loader):
            for batch in real_iter(loader):
                for t in (batch if isinstance(batch, (list, tuple)) else [batch]):
                    if isinstance(t, torch.Tensor):
                        t.__dict__["_on_the_cpu"] = "a batch as the DataLoader yields it"
                yield batch

        def all_reduce(tensor, *args, **kwargs):
            if rule.on_cpu(tensor):
                raise RuntimeError(f"all_reduce got a tensor on the CPU ({rule.on_cpu(tensor)}): on GPU workers the "
                                   "process group is NCCL's, which reduces GPU tensors only. Make it with "
                                   "device=ray.train.torch.get_device()")
            return real_all_reduce(tensor, *args, **kwargs)

        self.patches = contextlib.ExitStack()
        self.patches.enter_context(mock.patch.object(torch.utils.data.DataLoader, "__iter__", batches))
        self.patches.enter_context(mock.patch.object(dist, "all_reduce", all_reduce))
        return super().__enter__()

    def __exit__(self, *exc):
        self.patches.close()
        return super().__exit__(*exc)


def as_ray_worker(rank, world_size, local_world_size, train_func, model_class, config, marks, resume_from=None) -> dict:
    """train_func as worker `rank` of `world_size` (`local_world_size` per node), watched; resumed from the
    checkpoint folder `resume_from` when there is one."""
    logging.getLogger("ray.train").setLevel(logging.WARNING)   # spawned ranks start with Ray's default
    probe, guard = RankProbe(model_class), CollectiveGuard(marks, rank, world_size)
    checkpoint = None
    if resume_from:   # handed back as from a run's storage: a filesystem of its own (S3, NFS...), not a local path
        storage, name = os.path.split(resume_from.rstrip("/"))
        checkpoint = Checkpoint(path=name, filesystem=pyarrow.fs.SubTreeFileSystem(storage, pyarrow.fs.LocalFileSystem()))
    with simulated_worker(rank, world_size, local_world_size=local_world_size) as reports, \
            swapped(train_func.__globals__, preloaded_data(config) + probe.sharding()), \
            guard.installed(train_func.__globals__, checkpoint), \
            probe.watching(), device_rule(train_func.__code__):
        try:
            train_func(config)
        except BaseException as e:
            if probe.optimizer_holds_model is False:     # what the traceback alone does not say
                raise RuntimeError("the optimizer holds other tensors than the model's parameters: fully_shard "
                                   "replaces them, so build the optimizer after sharding") from e
            raise
    weights = probe.full_weights() if probe.model is not None else None
    return {"reports": [(r.metrics, r.files) for r in reports], "alone": guard.alone,
            "weights": weights if rank == 0 else None, **probe.facts()}


def run_port(train_func, model_class: type, world_size: int, local_world_size: int, config: dict,
             resume_from: str | None = None):
    """train_func on `world_size` ranks: a dict with each rank's facts ("ranks") and the final weights, or, when it
    fails, the failure as text."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as marks:   # the guard's arrival marks
        try:
            ranks = run_distributed(as_ray_worker, world_size, local_world_size, train_func, model_class, config,
                                    marks, resume_from, local_world_size=local_world_size, timeout_s=60)
        except (RuntimeError, TimeoutError) as e:
            lines = str(e).strip().splitlines()
            return "\n".join(lines[:1] + lines[-12:]) if len(lines) > 13 else str(e)
    return {"ranks": ranks, "weights": ranks[0]["weights"], "seconds": time.perf_counter() - started}


def one_process(train_one_process, config: dict) -> tuple:
    """The script on one process (on the CPU, like the simulated workers): its losses and its last checkpoint."""
    with tempfile.TemporaryDirectory() as folder:
        losses = train_one_process({**config, "device": "cpu", "checkpoint_dir": folder})
        saved = Path(folder) / "checkpoint.pt"          # written on the CPU: read back there
        return losses, torch.load(saved, weights_only=True)


def merge_checkpoint(run: dict, epoch: int, folder: str) -> str:
    """What Ray Train does in storage: every rank's files reported with `epoch` land in one checkpoint folder."""
    for result in run["ranks"]:
        for metrics, files in result["reports"]:
            if metrics.get("epoch") == epoch:
                for name, content in (files or {}).items():
                    (Path(folder) / name).parent.mkdir(parents=True, exist_ok=True)
                    (Path(folder) / name).write_bytes(content)
    return folder


def read_checkpoint(run: dict, epoch: int, config: dict, make_net, who: str = "the run") -> tuple:
    """(the plain DigitNet with the "model" of the checkpoint reported with `epoch`, its saved epoch, what DCP's
    metadata says of each saved entry), read in one process as an evaluation script would."""
    with tempfile.TemporaryDirectory() as folder:
        merge_checkpoint(run, epoch, folder)
        assert os.path.exists(os.path.join(folder, ".metadata")), (
            f"{who}: the checkpoint of epoch {epoch} holds {sorted(os.listdir(folder))}: write it with dcp.save "
            "(torch.distributed.checkpoint) on every rank")
        net = make_net({**config, "seed": config["seed"] + 1})   # other weights: all must come from the checkpoint
        state = {"model": net.state_dict(), "epoch": -1}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")                  # "torch.distributed is uninitialized": one process
                dcp.load(state, checkpoint_id=folder)
            saved = FileSystemReader(folder).read_metadata().state_dict_metadata
        except (Exception, CheckpointException) as e:            # DCP's exception is no Exception
            raise AssertionError(f"{who}: the checkpoint must be a DCP checkpoint of a dict with the keys 'model' (the "
                                 f"model's state dict), 'optimizer' and 'epoch': {type(e).__name__}: "
                                 f"{str(e).strip().splitlines()[-1]}") from None
    return net, state["epoch"], saved


def describe(run, config: dict, make_net, checkpoints=(), who: str = "the run") -> dict:
    """What the test cells hand in about a run (plain data): each rank's reports (the metrics, the checkpoint files
    by name and size), what the probe saw there, the weights the run ended with, and the checkpoints of the epochs
    `checkpoints` read back by one process (their weights, the saved epoch, DCP's description of every entry)."""
    if isinstance(run, str):
        return {"config": config, "error": run}
    ranks = [{"reports": [{"metrics": metrics, "files": {name: len(content) for name, content in (files or {}).items()}}
                          for metrics, files in result["reports"]],
              **{key: result[key] for key in ("alone", "memory", "optimizer_holds_model", "layers", "layers_gathered",
                                              "meshes", "unsharded", "construction_peak", "allocated_before_sharding",
                                              "to_empty_devices")}}
             for result in run["ranks"]]
    read = {}
    for epoch in checkpoints:
        try:
            net, saved_epoch, saved = read_checkpoint(run, epoch, config, make_net, who)
        except AssertionError as e:
            read[str(epoch)] = {"error": str(e)}
            continue
        read[str(epoch)] = {"error": None, "epoch": saved_epoch,
                            "weights": {name: p.detach() for name, p in net.named_parameters()},
                            "saved": {key: {"size": list(item.size), "chunks": len(item.chunks)}
                                      if isinstance(item, TensorStorageMetadata) else {"size": None}
                                      for key, item in saved.items()}}
    return {"config": config, "error": None, "ranks": ranks, "weights": run["weights"], "checkpoints": read,
            "seconds": run["seconds"]}


def handed(run: dict, *heavy: str) -> dict:
    """`run` as a test cell hands it in: its ranks, with only the "weights" or "checkpoints" its checks read."""
    return {key: value for key, value in run.items() if key not in ("weights", "checkpoints") or key in heavy}
