"""What a graded test cell hands to the grader: plain data, judged outside your kernel.

The course's grader never trusts what a kernel says about itself (an error or its absence, a printed
"Success"): code that ran in a kernel can change what that kernel reports. A test cell therefore hands in the
values it measured (``hand_in``): JSON data (tensors as their dtype, shape and raw bytes), shown as an output of
a MIME type of its own that JupyterLab does not draw. The grader reads that output from the graded notebook, in a
process where no notebook code ever ran, and applies the checks there (the visible ones you see in the notebook
and the hidden ones). ``asked`` is the other direction: the inputs the grader asks a test cell to run too (its
hidden cases, which are not in the notebook). Outside grading (``coursekit.runtime.is_grading``: nbgrader's
autograde and Validate, ``COURSE_GRADING=1``) nothing is handed in and nothing is asked.
"""
from __future__ import annotations

import base64
import json
import math
import numbers

from coursekit.runtime import is_grading, settings

MIME = "application/vnd.ray-train-course.evidence+json"
TENSOR = "__tensor__"      # the key that marks an encoded tensor: {TENSOR: dtype, "shape": [...], "bytes": base64}
ARRAY = "__ndarray__"      # a numpy array: {ARRAY: dtype.str, "shape", "bytes"}, or {ARRAY: "str", "shape", "values"}


def plain(value):
    """``value`` as JSON data: str, bool, int, float (finite, or the strings "nan"/"inf"/"-inf"), None, lists and
    string-keyed dicts of them, tensors (``{"__tensor__": dtype, "shape", "bytes"}``, their values on the CPU) and
    numpy arrays (``{"__ndarray__": dtype, "shape", "bytes"}``, strings as their values);
    sets become sorted lists, tuples lists, anything else its ``repr``."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, numbers.Integral):      # numpy's integers too
        return int(value)
    if isinstance(value, numbers.Real) and not type(value).__module__.startswith("torch"):   # numpy's floats too
        value = float(value)
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain(v) for v in value), key=repr)
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        import numpy as np

        if value.dtype.kind in "US":                 # strings: their values
            return {ARRAY: "str", "shape": list(value.shape), "values": [str(v) for v in value.reshape(-1)]}
        if value.dtype.kind in "biuf" and value.dtype.itemsize <= 8:
            a = np.ascontiguousarray(value)
            return {ARRAY: a.dtype.str, "shape": list(a.shape), "bytes": base64.b64encode(a.tobytes()).decode()}
        return repr(value)
    import torch

    if isinstance(value, torch.Tensor) and not value.is_meta and str(value.dtype).removeprefix("torch.") in DTYPES:
        t = value.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return {TENSOR: str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "bytes": base64.b64encode(raw).decode()}
    return repr(value)


DTYPES = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "uint8", "bool")


def tensor(data):
    """The tensor that ``plain`` encoded as ``data`` (a new CPU tensor made from the bytes, nothing unpickled);
    ValueError for anything else."""
    import torch

    if not (isinstance(data, dict) and data.get(TENSOR) in DTYPES and isinstance(data.get("bytes"), str)):
        raise ValueError(f"not an encoded tensor: {str(data)[:80]}")
    dtype, shape = getattr(torch, data[TENSOR]), [int(n) for n in data["shape"]]
    raw = bytearray(base64.b64decode(data["bytes"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape).clone()


def array(data):
    """The numpy array that ``plain`` encoded as ``data`` (made from the bytes or values, nothing unpickled);
    ValueError for anything else."""
    import numpy as np

    if not (isinstance(data, dict) and isinstance(data.get(ARRAY), str)):
        raise ValueError(f"not an encoded array: {str(data)[:80]}")
    shape = [int(n) for n in data["shape"]]
    if data[ARRAY] == "str":
        return np.array([str(v) for v in data["values"]]).reshape(shape)
    dtype = np.dtype(data[ARRAY])
    if dtype.kind not in "biuf" or dtype.hasobject:
        raise ValueError(f"not a numeric dtype: {data[ARRAY]}")
    return np.frombuffer(base64.b64decode(data["bytes"]), dtype=dtype).reshape(shape).copy()


def hand_in(grade_id: str, **data) -> None:
    """Hand this test cell's evidence (``data``, made plain) to the grader, when grading."""
    if not is_grading():
        return
    from IPython.display import display

    payload = json.loads(json.dumps({"grade_id": grade_id, "data": plain(data)}))
    display({MIME: payload, "text/plain": f"handed in to the grader: {grade_id}"}, raw=True)


def asked(grade_id: str) -> list:
    """The inputs the grader asks this test cell to run besides its own (its hidden cases): a list, empty outside
    grading."""
    if not is_grading():
        return []
    value = settings().asked.get(grade_id, [])
    return value if isinstance(value, list) else []


def attempt(function, *args, **kwargs) -> dict:
    """``{"value": function(*args, **kwargs), "error": None}``, or ``{"value": None, "error": "..."}`` when it
    raised: what a test cell hands in about a run, whether or not it worked."""
    try:
        return {"value": function(*args, **kwargs), "error": None}
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001  (the grader reports the failure, whatever it was; DCP's
        # CheckpointException is a BaseException, not an Exception)
        return {"value": None, "error": f"{type(e).__name__}: {e}"[-2000:]}
