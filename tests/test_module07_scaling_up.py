"""Module 07 outside the notebook: the five comparable scripts. Their training functions run on 2 real
gloo ranks (Ray Train's context simulated, no Ray), and HSDP and TP x FSDP2 on 2 nodes x 2: every strategy
trains like DDP on the same batches, holds the memory the planner predicts (within 10%), model state and
activations (with and without activation checkpointing), the scripts fail clearly when misused, run in Binder
mode (Ray Train's local mode) inside Binder's memory, and they hold no line of any exercise answer."""
import importlib
import json
import subprocess
import sys

import pytest

from autograder.contain import run_limited
from coursekit.distributed import run_distributed
from coursekit.planner import compare, vit_parameters
from coursekit.testing import simulated_worker
from helpers import PY, REPO
from test_notebooks import BINDER_MIB, CUDA_BUILD_EXTRA_MIB

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


def _run_each(rank, world_size, module, configs: dict):
    """_run for each config in turn, on the same ranks (one fork of 4 ranks for HSDP and TP)."""
    return {name: _run(rank, world_size, module, config) for name, config in configs.items()}


#: name: (script, world size, strategy for the planner, config changes, the planner's options)
STRATEGY_RUNS = {
    "ddp": ("train_ray_ddp", 2, "ddp", {}, {}),
    "fsdp2": ("train_ray_fsdp2", 2, "fsdp2", {}, {}),
    "fsdp2 + AC": ("train_ray_fsdp2", 2, "fsdp2", {"checkpointing": True}, {"checkpointing": True}),
    "zero1": ("train_ray_deepspeed", 2, "zero1", {"stage": 1}, {}),
    "zero2": ("train_ray_deepspeed", 2, "zero2", {"stage": 2}, {}),
    "zero3": ("train_ray_deepspeed", 2, "zero3", {"stage": 3}, {}),
    "hsdp": ("train_ray_fsdp2", 4, "hsdp", {"hsdp": 2}, {"ranks_per_node": 2}),
    "tp x fsdp2 + AC": ("train_ray_fsdp2", 4, "tp_fsdp", {"tp": 2, "checkpointing": True},
                        {"tp": 2, "checkpointing": True}),
}


@pytest.mark.slow
def test_every_strategy_trains_like_ddp_and_holds_the_predicted_memory(scripts):
    runs = {}
    for name, (script, world_size, _, changes, _) in STRATEGY_RUNS.items():
        if world_size == 2:
            runs[name] = run_distributed(_run, 2, scripts[script], _config(scripts, **changes), timeout_s=300)
    four = {name: _config(scripts, **changes) for name, (_, world_size, _, changes, _) in STRATEGY_RUNS.items()
            if world_size == 4}                              # 2 nodes x 2 ranks, in one group of forked ranks
    by_rank = run_distributed(_run_each, 4, scripts["train_ray_fsdp2"], four, timeout_s=300)
    runs.update({name: [ranks[name] for ranks in by_rank] for name in four})
    reference = runs["ddp"][0]["losses"]
    for name, ranks in runs.items():
        rank0 = ranks[0]
        assert abs(rank0["losses"][0] - reference[0]) < 1e-3, f"{name}: {rank0['losses']} vs DDP {reference}"
        assert rank0["world_size"] == STRATEGY_RUNS[name][1] and rank0["samples_per_s"] > 0
        assert 0 <= rank0["test_accuracy"] <= 1
        assert all(r["reports"] == 1 for r in ranks), "one report per epoch from every rank"
    assert [r["checkpoints"] for r in runs["ddp"]] == [1, 0], "DDP: rank 0 checkpoints"
    for name in set(runs) - {"ddp"}:
        assert all(r["checkpoints"] == 1 for r in runs[name]), f"{name}: every rank saves its shard"
    # the gathered model (qkv's rows put back in order after TP) predicts as FSDP2's does: the same weights
    assert runs["tp x fsdp2 + AC"][0]["test_accuracy"] == runs["fsdp2"][0]["test_accuracy"]
    config = _config(scripts)
    vit = vit_parameters(**config["vit"])
    rows = [{"strategy": STRATEGY_RUNS[name][2], "world_size": STRATEGY_RUNS[name][1], **memory,
             **STRATEGY_RUNS[name][4], "tp_params": vit["tp"] if "tp" in STRATEGY_RUNS[name][4] else None}
            for name, ranks in runs.items() for memory in ranks[0]["memory_by_rank"]]
    # the scripts: no accumulation; the FSDP2 script measures its activations too
    table = compare(rows, vit["total"], "fp32", tolerance=0.10, accumulation=False, vit=config["vit"])
    assert table["within"].all(), table.to_string()
    assert table["activations ratio"].notna().sum() == 4, table.to_string()


@pytest.mark.slow
@pytest.mark.parametrize("script, args", [("train_ray_fsdp2", ["--activation-checkpointing"]),
                                          ("train_ray_deepspeed", ["--stage", "3"])])
def test_script_in_binder_mode_fits_binders_memory(script, args, tmp_path):
    """On Binder the sharded scripts run Ray Train's local mode (2 ranks forked from the driver, no Ray), inside
    Binder's memory as the notebook test counts it: 2 GiB plus the CUDA build's extra for the one process that
    imports torch (the ranks are its forks)."""
    out, limit_mib = tmp_path / "metrics.json", BINDER_MIB + CUDA_BUILD_EXTRA_MIB
    env = {"COURSE_PLATFORM": "binder", "COURSE_SIZE": "smoke", "COURSE_STORAGE": str(tmp_path / "storage")}
    run = run_limited([PY, f"{script}.py", "--smoke-test", *args, "--metrics-out", str(out)], MODULE, env,
                      timeout=300, memory=limit_mib * 2**20, log=tmp_path / "log.txt")
    print(f"{script} in Binder mode: {run.seconds:.0f} s, peak {run.peak_rss / 2**20:.0f} of {limit_mib} MiB")
    assert not run.killed and run.returncode == 0, f"{run.killed or run.returncode}: {run.output[-3000:]}"
    assert "Ray Train local mode: 2 forked rank(s)" in run.output and "Started a local Ray" not in run.output
    m = json.loads(out.read_text())
    assert m["world_size"] == 2 and len(m["losses"]) == 2 and len(m["memory_by_rank"]) == 2
    assert m["losses"][-1] < m["losses"][0] and m["test_accuracy"] > 0.3


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


@pytest.mark.parametrize("args, message", [(["--hsdp", "2", "--tp", "2"], "choose --hsdp or --tp"),
                                           (["--num-workers", "6", "--tp", "4"], "--tp 4 must divide --num-workers")])
def test_fsdp2_script_refuses_meshes_it_cannot_build(scripts, args, message, capsys):
    with pytest.raises(SystemExit):
        scripts["train_ray_fsdp2"].parse_args(["--smoke-test", *args])
    assert message in capsys.readouterr().err


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
    module's exercise answer (module 07's capstone port included) may be in them, a script's own solution region (the
    FSDP2 script's checkpoint step, stubbed in course/) aside (the release's own rule,
    autograder.student_release.answer_leaks, applied to this folder in solutions/ and in course/)."""
    from autograder.release import modules
    from autograder.student_release import _lines, answers

    every = {(m, entry[1]): entry[2] for m in modules() for entry in answers(m)}   # (index, grade_id, lines, ...)
    for folder in (MODULE, REPO / "course" / "07_scaling_up"):
        for script in sorted(folder.glob("*.py")):
            text = _lines(script.read_text())
            hits = {f"{m}/{gid}": sorted(text & lines)[:2] for (m, gid), lines in every.items()
                    if text & lines and (m, gid) != ("07_scaling_up", script.name)}   # its own region: stubbed in course/
            assert not hits, f"{script.relative_to(REPO)} holds lines of answers: {hits}"


# ------------------------------------------------------------- the capstone (section 5 of the notebook)

def _code_cells(module: str = "07_scaling_up") -> list[str]:
    import nbformat

    nb = nbformat.read(MODULE / f"{module}.ipynb", as_version=4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def _capstone_numbers() -> tuple[int, int]:
    """(MEMORY_BUDGET, the number of parameters of the colleague's DigitNet), from the notebook's own cells."""
    import ast
    import os

    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, RandomSampler

    from coursekit.data import load_digits

    cells = _code_cells()
    script = next(c for c in cells if c.startswith("class Block(nn.Module):"))
    budget_cell = next(c for c in cells if c.startswith("MEMORY_BUDGET = "))
    values = {t.id: ast.literal_eval(node.value) for node in ast.parse(budget_cell).body
              if isinstance(node, ast.Assign) and len(node.targets) == 1
              for t in node.targets if isinstance(t, ast.Name) and t.id in ("MEMORY_BUDGET", "CAPSTONE_SHAPE")}
    namespace = {"torch": torch, "nn": nn, "F": F, "DataLoader": DataLoader, "RandomSampler": RandomSampler,
                 "load_digits": load_digits, "os": os}
    exec(compile(script, "capstone-script", "exec"), namespace)
    net = namespace["build_net"]({**values["CAPSTONE_SHAPE"], "seed": 0})
    return values["MEMORY_BUDGET"], sum(p.numel() for p in net.parameters())


def test_the_capstone_budget_needs_a_sharded_strategy_on_all_four_ranks():
    """The capstone's premise, by the planner's numbers (fp32, AdamW): one process or a DDP worker is over the
    budget, so are ZeRO-1 and ZeRO-2 on 4 ranks (whole parameters on every rank); FSDP2 and ZeRO-3 fit on 4 ranks,
    and nothing fits on 2 (one node). Question 2's answer ("a c") and the notebook's text say exactly this."""
    from coursekit.planner import predict

    budget, params = _capstone_numbers()
    per_rank = {(n, s): predict(params, n, s, "fp32")["device"] for n in (1, 2, 4)
                for s in ("ddp", "zero1", "zero2", "fsdp2", "zero3")}
    fits = {key for key, held in per_rank.items() if held <= budget}
    assert fits == {(4, "fsdp2"), (4, "zero3")}, (budget, params, per_rank)
    assert per_rank[(4, "fsdp2")] < per_rank[(4, "zero3")], "question 2, c: ZeRO-3 holds more than FSDP2 here"
    assert 16 * params > 2 * budget, "DDP must be far over the budget, not just over it"


class _Normalise:
    """A function's code with every name (variables, arguments, imported functions) replaced by its order of first
    use and every constant by its type: renaming or re-wording leaves it unchanged."""

    @staticmethod
    def tokens(function) -> list[str]:
        import ast
        import re

        class Rename(ast.NodeTransformer):
            def __init__(self):
                self.names = {}

            def _name(self, name):
                return self.names.setdefault(name, f"n{len(self.names)}")

            def visit_Name(self, node):
                return ast.copy_location(ast.Name(id=self._name(node.id), ctx=node.ctx), node)

            def visit_arg(self, node):
                return ast.copy_location(ast.arg(arg=self._name(node.arg)), node)

            def visit_Constant(self, node):
                return ast.copy_location(ast.Constant(value=type(node.value).__name__), node)

            def visit_FunctionDef(self, node):
                body = node.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]                                  # the docstring
                node.name, node.body, node.decorator_list, node.returns = "f", body, [], None
                self.generic_visit(node)
                return node

        tree = Rename().visit(ast.parse(ast.unparse(function)).body[0])
        return re.findall(r"\w+|[^\w\s]", ast.unparse(tree))


def _functions(text: str) -> list:
    import ast

    return [node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.FunctionDef)]


def _similarity(a: list, b: list) -> float:
    import difflib

    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


# At or above this similarity a function counts as the capstone's answer (measured: the answer with its variables
# renamed 1.0, with the two lines that shard the layers deleted 0.81; a correct port written independently
# (tests/mistakes/07_scaling_up.py's RIGHT) 0.56; module 07's own FSDP2 script's train_func 0.51).
SAME_ANSWER = 0.75


def test_no_released_script_holds_the_capstone_answer_even_renamed():
    """No function of any script the course releases (course/*/*.py: module 07's folder and every earlier one) is
    the capstone's port by the shape of its code, whatever its names: the released FSDP2 script of the comparison
    trains another model, another way, and must stay far from the answer."""
    from autograder.samples import solution_answers

    answer = next(f for f in _functions(solution_answers("07_scaling_up")["train_func"]) if f.name == "train_func")
    shape = _Normalise.tokens(answer)
    renamed = solution_answers("07_scaling_up")["train_func"].replace("net", "model").replace("adamw", "opt")
    assert _similarity(shape, _Normalise.tokens(_functions(renamed)[0])) >= 0.99, "the measure ignores names"
    close = {}
    for script in sorted((REPO / "course").glob("*/*.py")):
        for function in _functions(script.read_text()):
            similarity = _similarity(shape, _Normalise.tokens(function))
            if similarity >= SAME_ANSWER:
                close[f"{script.relative_to(REPO)}:{function.name}"] = round(similarity, 2)
    assert not close, f"released functions shaped like the capstone's answer: {close}"


def _bf16_step(rank, world_size, module, config):
    """One step of the FSDP2 script's sharding with --bf16: the dtypes a block computes in and the sharded
    parameters and gradients keep."""
    import torch
    import torch.nn.functional as F

    model = module.build_model(config)
    module.shard(model, config, torch.device("cpu"), world_size)
    seen = []
    model.blocks[0].attn.qkv.register_forward_hook(lambda m, i, o: seen.append((str(m.weight.dtype), str(o.dtype))))
    inputs = torch.randn(4, 1, 28, 28)
    F.cross_entropy(model(inputs).float(), torch.tensor([0, 1, 2, 3])).backward()
    qkv = model.blocks[0].attn.qkv.weight
    return {"compute": seen[0], "shard": str(qkv.dtype), "grad": str(qkv.grad.dtype)}


@pytest.mark.parametrize("flag, compute", [([], "torch.float32"), (["--bf16"], "torch.bfloat16")])
def test_fsdp2_script_bf16_computes_in_bf16_and_keeps_fp32_shards(scripts, flag, compute):
    """--bf16 (as the DeepSpeed script's) is module 05's MixedPrecisionPolicy: bf16 compute, fp32 shards and
    gradients; without it everything is fp32."""
    config = dict(_config(scripts), **{k: v for k, v in scripts["train_ray_fsdp2"].parse_args(["--smoke-test", *flag]).items()
                                       if k == "bf16"})
    (result,) = run_distributed(_bf16_step, 1, scripts["train_ray_fsdp2"], config, timeout_s=120)
    assert result == {"compute": (compute, compute), "shard": "torch.float32", "grad": "torch.float32"}, result
