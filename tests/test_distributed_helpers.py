"""run_distributed (forked gloo groups) and simulated_worker (Ray Train's context without Ray)."""
import pytest
import torch
import torch.distributed as dist

from coursekit.distributed import run_distributed
from coursekit.testing import simulated_worker


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, world_size, t.item()


def test_run_distributed_forms_a_real_group():
    assert run_distributed(_all_reduce, 3) == [(0, 3, 6.0), (1, 3, 6.0), (2, 3, 6.0)]


def _fails_on_rank_1(rank, world_size):
    if rank == 1:
        raise ValueError("student bug")
    return rank


def test_a_failing_rank_is_reported_with_its_traceback():
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*student bug"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=30)


def _rank0_skips_collective(rank, world_size):
    if rank == 1:
        dist.barrier()
    return rank


@pytest.mark.slow
def test_a_hanging_collective_times_out_instead_of_blocking():
    with pytest.raises((TimeoutError, RuntimeError)):
        run_distributed(_rank0_skips_collective, 2, timeout_s=8)


def test_simulated_worker_answers_ray_train_calls_and_records_reports(tmp_path):
    import ray.train

    (tmp_path / "model.pt").write_bytes(b"x")
    with simulated_worker(rank=1, world_size=4) as reports:
        ctx = ray.train.get_context()
        assert (ctx.get_world_rank(), ctx.get_world_size()) == (1, 4)
        ray.train.report({"loss": 1.0})
        ray.train.report({"loss": 0.5}, checkpoint=ray.train.Checkpoint.from_directory(tmp_path))
    assert [r.metrics for r in reports] == [{"loss": 1.0}, {"loss": 0.5}]
    assert not reports[0].has_checkpoint and reports[1].files == {"model.pt": b"x"}
    with pytest.raises(ValueError):
        with simulated_worker(rank=2, world_size=2):
            pass


def _ddp_train_one_step(rank, world_size):
    import ray.train.torch

    from coursekit.models import build_small_cnn

    with simulated_worker(rank, world_size):
        torch.manual_seed(0)
        model = ray.train.torch.prepare_model(build_small_cnn())
    return type(model).__name__


def test_prepare_model_wraps_in_ddp_inside_a_simulated_group():
    assert run_distributed(_ddp_train_one_step, 2) == ["DistributedDataParallel"] * 2


def _returns_tensors(rank, world_size):
    return {"w": torch.full((3,), float(rank))}


def test_tensors_come_back_after_the_processes_exit():
    out = run_distributed(_returns_tensors, 2)
    assert torch.equal(out[1]["w"], torch.ones(3))


def test_start_method_is_fork_on_a_cpu_machine_and_can_be_forced(monkeypatch):
    from coursekit.distributed import start_method

    monkeypatch.delenv("COURSE_START_METHOD", raising=False)
    assert start_method() == ("spawn" if torch.cuda.is_available() else "fork")
    monkeypatch.setenv("COURSE_START_METHOD", "spawn")
    assert start_method() == "spawn"
    monkeypatch.setenv("COURSE_START_METHOD", "thread")
    with pytest.raises(ValueError, match="fork, spawn"):
        start_method()


@pytest.mark.slow
def test_spawned_ranks_run_a_function_defined_on_the_fly(monkeypatch):
    """The GPU-machine path: spawned processes (no fork), the function sent by value, GPUs hidden."""
    monkeypatch.setenv("COURSE_START_METHOD", "spawn")
    offset = torch.tensor([10.0])   # a value the function closes over, as a notebook global would be

    def closure(rank, world_size, scale):
        import os

        t = torch.tensor([float(rank + 1)]) * scale + offset
        dist.all_reduce(t)
        return rank, t.item(), os.environ["CUDA_VISIBLE_DEVICES"], torch.cuda.is_available()

    assert run_distributed(closure, 2, 2.0, timeout_s=120) == [(0, 26.0, "", False), (1, 26.0, "", False)]
    with pytest.raises(RuntimeError, match="rank 1 of 2 failed(.|\n)*student bug"):
        run_distributed(_fails_on_rank_1, 2, timeout_s=60)


def _where(rank, world_size):
    import os

    return int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["GROUP_RANK"])


def test_run_distributed_simulates_two_nodes_of_two():
    assert run_distributed(_where, 4, local_world_size=2) == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    with pytest.raises(ValueError, match="do not fill nodes"):
        run_distributed(_where, 3, local_world_size=2)


def test_simulated_worker_on_two_nodes_tells_local_from_global_rank():
    import ray.train

    with simulated_worker(3, 4, local_world_size=2):
        ctx = ray.train.get_context()
        assert (ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_node_rank()) == (3, 1, 1)
        assert (ctx.get_world_size(), ctx.get_local_world_size()) == (4, 2)
    with simulated_worker(1, 2):   # default: one node
        assert ray.train.get_context().get_local_rank() == 1
    with pytest.raises(ValueError):
        with simulated_worker(0, 4, local_world_size=3):
            pass


def test_check_concept_explains_right_and_wrong_answers(capsys):
    from coursekit.testing import check_concept

    check_concept(" B ", "b", "because")
    check_concept(["c", "a"], "a, c", "several letters, any order")
    assert "Right. because" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="Why: because"):
        check_concept("a", "b", "because")
    with pytest.raises(AssertionError):
        check_concept("a", "a c", "all of them")


def test_simulated_report_refuses_tensor_metrics_like_ray_train():
    import ray.train

    with simulated_worker(0, 1):
        with pytest.raises(ValueError, match="tensors"):
            ray.train.report({"loss": torch.tensor(1.0)})
