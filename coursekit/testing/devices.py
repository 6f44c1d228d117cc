"""Where each tensor would live on a GPU node, followed on a CPU: the checks of modules 02 and 06 run your code on
CPU ranks and still tell you what would fail on a GPU worker.

``ray.train.torch.get_device()`` (and, in module 06, ``engine.device``) answers ``ACCELERATOR``, a stand-in for
``cuda:<local rank>``. A tensor is "on the accelerator" when it was made there (``device=ACCELERATOR``, or the
``.device`` of a tensor that is), moved there (``.to``) or computed from one that is. Recorded: a collective on a
tensor left on the CPU (NCCL reduces GPU tensors only) and an operation in your code that mixes the two (on a GPU:
"Expected all tensors to be on the same device"). Library code is never blamed, and the bookkeeping never breaks
your code.
"""
from __future__ import annotations

import contextlib
import linecache
import os
import sys
from unittest import mock

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ACCELERATOR = torch.device("cpu", 0)   # the worker's device in the checks: a stand-in for cuda:<local rank>
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast")
_DISPATCH = tuple(os.path.join(os.path.dirname(torch.__file__), name + os.extsep + "py")   # torch's wrappers
                  for name in ("_tensor", "overrides", "functional"))
_NO_MIXING_CHECK = {"copy_", "__setitem__", "__getitem__", "to", "cpu", "cuda", "item", "tolist"}
_IN_PLACE_OPERATORS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                               "xor")}


def _libraries() -> tuple:
    """The folders of the libraries whose code is never "yours": torch, Ray, DeepSpeed (when imported), coursekit,
    the standard library."""
    import coursekit

    names = ("torch", "ray", "deepspeed")
    modules = [sys.modules[n] for n in names if n in sys.modules] + [coursekit, os]
    return tuple(os.path.dirname(m.__file__) + os.sep for m in modules)


def tensors_in(obj):
    """Every tensor in a (nested) list, tuple or dict."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)


def on_accelerator(t) -> bool:
    return t.__dict__.get("_on_accelerator", False)


def mark_on_accelerator(batches):
    """The batches as a GPU worker's loader hands them over: each tensor on the worker's device."""
    for batch in batches:
        for t in tensors_in(batch):
            t.__dict__["_on_accelerator"] = True
        yield batch


def your_line(up: int, libraries: tuple | None = None):
    """'line N `<code>`' of the code ``up`` frames above the caller when it is yours (not a library's), else None."""
    frame = sys._getframe(up + 1)
    while frame is not None and frame.f_code.co_filename.startswith(_DISPATCH):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith(libraries or _libraries()):
        return None
    text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"line {frame.f_lineno}" + (f" `{text}`" if text else "")


class DeviceTracker(TorchFunctionMode):
    """Follows which tensors would be on the worker's GPU, and records what would fail there (``problems``).

    ``device_in_your_code_only``: ``tensor.device`` answers ``ACCELERATOR`` to your code only (libraries such as
    DeepSpeed see the real CPU device, which they need). ``follow_data``: ``param.data = t`` moves the parameter
    where ``t`` is (``Module.to`` does that)."""

    def __init__(self, device_in_your_code_only: bool = False, follow_data: bool = True):
        super().__init__()
        self.problems = []
        self.device_in_your_code_only, self.follow_data = device_in_your_code_only, follow_data
        self.libraries = _libraries()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if owner is torch._C.TensorBase.__dict__["device"]:   # tensor.device
            real = func(*args)
            yours = not self.device_in_your_code_only or your_line(1, self.libraries)
            return ACCELERATOR if real.type == "cpu" and on_accelerator(args[0]) and yours else real
        out = func(*args, **kwargs)
        try:
            self._follow(func, owner, args, kwargs, out)
        except Exception:   # the bookkeeping never breaks your code
            pass
        return out

    def _follow(self, func, owner, args, kwargs, out):
        if owner is torch._C.TensorBase.__dict__["data"]:   # param.data = moved (Module.to)
            if self.follow_data:
                args[0].__dict__["_on_accelerator"] = on_accelerator(args[1])
            return
        name = getattr(func, "__name__", "")
        inputs = list(tensors_in((args, kwargs)))
        if name == "to":
            other = [a for a in args[1:] if isinstance(a, torch.Tensor)]
            device = None if other else torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            there = on_accelerator(other[0]) if other else (
                on_accelerator(args[0]) if device is None else device == ACCELERATOR)
        elif kwargs.get("device") is not None:
            there = torch.device(kwargs["device"]) == ACCELERATOR
        elif name == "cpu" or (name in ("tensor", "as_tensor") and not (args and isinstance(args[0], torch.Tensor))):
            there = False   # made from Python numbers: on the default device, the CPU
        else:
            there = any(on_accelerator(t) for t in inputs)
            if there and name not in _NO_MIXING_CHECK:
                in_place = name in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
                if in_place and not on_accelerator(args[0]):
                    on_cpu = [args[0]]
                else:   # a 0-dim CPU tensor may join a GPU operation as a number; anything bigger may not
                    on_cpu = [t for t in inputs if not on_accelerator(t) and t.dim() > 0]
                line = your_line(2, self.libraries) if on_cpu else None
                if line:
                    self.problems.append(f"{line} mixes a tensor on the worker's device with one on the CPU "
                                         f"({name}): on a GPU it raises 'Expected all tensors to be on the same device'")
        for o in tensors_in(out):
            if not any(o is t for t in inputs):
                o.__dict__["_on_accelerator"] = there


def _collective(real, tracker: DeviceTracker, why: str):
    def collective(tensor, *args, **kwargs):
        line = your_line(1, tracker.libraries)
        if line and not all(on_accelerator(t) for t in tensors_in(tensor)):
            tracker.problems.append(f"{line}: dist.{real.__name__} gets a tensor on the CPU{why}")
        return real(tensor, *args, **kwargs)
    return collective


@contextlib.contextmanager
def tracking_devices(why: str = "; on GPUs the process group is NCCL, which reduces GPU tensors only",
                     collectives=COLLECTIVES, **options):
    """Inside: ``ray.train.torch.get_device()`` is ``ACCELERATOR``, your collectives and tensor operations are
    followed; yields the ``DeviceTracker`` (its ``problems``: each once, in order). ``why`` ends the message of a
    collective on a CPU tensor; ``options`` go to ``DeviceTracker``."""
    import ray.train.torch

    tracker = DeviceTracker(**options)
    wrapped = {n: _collective(getattr(dist, n), tracker, why) for n in collectives}
    with mock.patch.object(ray.train.torch, "get_device", lambda: ACCELERATOR), mock.patch.multiple(dist, **wrapped):
        with tracker:
            yield tracker
    tracker.problems[:] = list(dict.fromkeys(tracker.problems))
