"""Multi-node for real on one machine: a two-node Ray cluster started with the `ray` CLI.

A head node and a worker node, each a separate Ray node with its own raylet, object store,
temp dir and CPUs, as on two machines. Module 02's script joins the cluster (RAY_ADDRESS),
its two training workers land on different nodes (STRICT_SPREAD; each node has CPUs for both,
so with the default PACK they share one node), and the checkpoint reaches the shared storage
folder that both nodes see (an NFS mount / /mnt/cluster_storage on a real cluster).

Stopping: `ray stop` has no address or temp-dir option; it kills every Ray process on the
machine by name (other people's clusters too). So each node runs `ray start --block` in its own
process session: on SIGTERM the blocking `ray start` stops the raylet, object store, GCS and
agents it started; we then SIGKILL whatever is left of that process group and any
process whose command line names one of our private temp dirs (Ray's worker processes do).
"""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from helpers import PY, REPO
from coursekit.proctree import kill_named, kill_tree
from coursekit.distributed import free_port

SCRIPT_DIR = REPO / "solutions" / "02_ray_train"
RAY_CLI = str(Path(PY).parent / "ray")
CPUS_PER_NODE = 2  # more than one worker would fit on a node: the placement strategy spreads them
NODE_START_S = 120  # the 2-core machine is shared: a raylet can take a minute to come up
START_ATTEMPTS = 2

# Prints the alive nodes as JSON once there are `want` of them (the test's view of the cluster).
NODES_PROBE = """
import json, sys, time, ray
want = int(sys.argv[1])
ray.init(logging_level="ERROR", log_to_driver=False)   # RAY_ADDRESS says which cluster
deadline = time.time() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= want or time.time() > deadline:
        break
    time.sleep(1)
print("NODES", json.dumps([{"id": n["NodeID"], "cpus": n["Resources"].get("CPU", 0)} for n in alive]))
"""


def _stop_node(node: subprocess.Popen) -> None:
    """Stop one node as its `ray start --block` does on SIGTERM (Kubernetes stops pods this way):
    the node drains, then stops the raylet, GCS and agents it started. Then SIGKILL whatever is
    left in its process group. Only the `ray start` process gets the SIGTERM: it stops its
    children in order (a GCS killed first would leave the others waiting for it)."""
    try:
        node.terminate()
        node.wait(timeout=45)
    except subprocess.TimeoutExpired:
        pass
    kill_tree(node.pid, group=True)
    node.wait(timeout=15)


@contextlib.contextmanager
def local_cluster(tmp_path, head_resources: list[str], worker_resources: list[str]):
    """Head + worker node on this machine, each advertising the resources given as `ray start` options.
    Yields (address, env for drivers, {alive node id: its CPUs})."""
    # Short, private temp dirs: Ray's unix sockets live under them (107-character limit) and
    # their paths identify our processes at teardown.
    temp_dirs = [tempfile.mkdtemp(prefix="rmh", dir="/tmp"), tempfile.mkdtemp(prefix="rmw", dir="/tmp")]
    port = free_port()
    address = f"127.0.0.1:{port}"
    # Ray >= 2.5x clusters use token authentication. A real cluster shares one token between its
    # nodes and its drivers (~/.ray/auth_token or RAY_AUTH_TOKEN); this one gets its own.
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           # On SIGTERM a node first drains (for Ray Serve); a head node waits the full 30 s.
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    env.pop("RAY_ADDRESS", None)
    common = [f"--object-store-memory={256 * 2**20}", "--block"]
    nodes: list[subprocess.Popen] = []
    logs = [tmp_path / "head.log", tmp_path / "worker.log"]

    def fail(what):
        tails = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in logs if p.exists())
        pytest.fail(f"{what}\n{tails}")

    def start(args, temp_dir, log, what):
        """`ray start ... --block`; wait until the node has written its address file (it is up)."""
        node_env = env
        if any(a.startswith("--num-gpus=") and a != "--num-gpus=0" for a in args):
            # logical GPUs on a machine without any: Ray refuses them under an empty CUDA_VISIBLE_DEVICES
            node_env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        for _ in range(START_ATTEMPTS):
            with open(log, "w") as out:
                node = subprocess.Popen([RAY_CLI, "start", *args, f"--temp-dir={temp_dir}", *common], env=node_env,
                                        stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            nodes.append(node)
            deadline = time.time() + NODE_START_S
            while not (Path(temp_dir) / "ray_current_cluster").exists():
                if node.poll() is not None or time.time() > deadline:
                    break
                time.sleep(1)
            else:
                return
            # On a busy 2-core machine a raylet can die at start-up (its dashboard agent gets a
            # hard-coded 15 s, ray-project/ray#65983): stop what is left and start it again.
            _stop_node(node)
            kill_named([temp_dir])
        fail(f"the {what} node did not start ({START_ATTEMPTS} attempts)")

    try:
        started = time.time()
        start(["--head", f"--port={port}", "--include-dashboard=false", *head_resources], temp_dirs[0], logs[0],
              "head")
        start([f"--address={address}", *worker_resources], temp_dirs[1], logs[1], "worker")
        probe = subprocess.run([PY, "-c", NODES_PROBE, "2", "60"], capture_output=True,
                               text=True, timeout=180, env={**env, "RAY_ADDRESS": address})
        if "NODES " not in probe.stdout:
            fail(f"could not list the cluster's nodes: {probe.stderr[-2000:]}")
        alive = json.loads(probe.stdout.split("NODES ", 1)[1])
        if len(alive) != 2:
            fail(f"expected 2 alive nodes, got {alive}")
        print(f"\ntwo-node cluster at {address} up in {time.time() - started:.0f} s")
        yield address, {**env, "RAY_ADDRESS": address}, {n["id"]: n["cpus"] for n in alive}
    finally:
        for node in reversed(nodes):  # the worker node first, then the head
            _stop_node(node)
        print(f"two-node cluster stopped ({kill_named(temp_dirs)} stray processes killed)")
        for d in temp_dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def two_node_cluster(tmp_path):
    """Two nodes with CPUS_PER_NODE CPUs each. Yields (address, env for drivers, alive node ids)."""
    cpus = [f"--num-cpus={CPUS_PER_NODE}", "--num-gpus=0"]
    with local_cluster(tmp_path, cpus, cpus) as (address, env, nodes):
        assert list(nodes.values()) == [CPUS_PER_NODE] * 2, nodes  # each node has its own CPUs
        yield address, env, set(nodes)


@pytest.mark.slow
def test_ddp_script_spreads_workers_over_two_nodes_and_checkpoints_to_shared_storage(two_node_cluster, tmp_path):
    address, env, node_ids = two_node_cluster
    shared = tmp_path / "shared"  # both nodes see this folder, as they would an NFS mount
    out = tmp_path / "metrics.json"
    proc = subprocess.run([PY, "train_ray_ddp.py", "--smoke-test", "--num-workers", "2",
                           "--placement-strategy", "STRICT_SPREAD", "--name", "two-nodes",
                           "--metrics-out", str(out)],
                          cwd=SCRIPT_DIR, capture_output=True, text=True, timeout=600,
                          env={**env, "COURSE_STORAGE": str(shared)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    m = json.loads(out.read_text())

    # one training worker on each node of our cluster
    assert len(m["worker_node_ids"]) == 2 and set(m["worker_node_ids"]) == node_ids, (m, node_ids)
    assert "2 workers ran on 2 node(s) (STRICT_SPREAD)" in proc.stdout

    # the run and its checkpoints are in the shared storage folder
    run = Path(m["path"])
    assert run == shared / "two-nodes" and run.is_dir(), m["path"]
    models = sorted(run.glob("checkpoint_*/model.pt"))
    assert models and all(p.stat().st_size > 0 for p in models), sorted(p.name for p in run.iterdir())

    # and it learned
    assert len(m["losses"]) == 2 and m["losses"][-1] < m["losses"][0], m["losses"]
    assert m["test_accuracy"] > 0.5, m


@pytest.mark.slow
def test_strict_spread_on_one_machine_is_refused_with_a_clear_message():
    """Without a cluster (no RAY_ADDRESS) there is one node: STRICT_SPREAD of 2 workers would hang."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([PY, "train_ray_ddp.py", "--smoke-test", "--num-workers", "2",
                           "--placement-strategy", "STRICT_SPREAD"], cwd=SCRIPT_DIR,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "2 workers need 2 nodes, but this cluster has 1" in proc.stderr, proc.stderr[-2000:]


def test_check_placement_knows_rays_strategies_and_refuses_others():
    from ray.train import ScalingConfig

    from coursekit.scaling import PLACEMENT_STRATEGIES, ScalingError, check_placement

    assert PLACEMENT_STRATEGIES[0] == ScalingConfig().placement_strategy == "PACK"  # Ray's default first
    for strategy in ("PACK", "SPREAD", "STRICT_PACK"):
        check_placement(2, strategy)
    with pytest.raises(ScalingError, match="'spread' is not one of PACK, SPREAD"):
        check_placement(2, "spread")


# A driver on this machine (no GPU) that asks the cluster. Prints what the course's code would use.
DEFAULTS_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from coursekit.runtime import detect
from coursekit.scaling import check_scaling, worker_resources
import train_ray_fsdp2
rt = detect()
workers = worker_resources(rt)                          # joins the cluster named by RAY_ADDRESS
cfg = train_ray_fsdp2.parse_args([])                    # module 07's script, with its defaults
import ray
print("DEFAULTS", json.dumps({
    "driver": [rt.num_gpus, rt.backend],
    "workers": [workers.cpus, workers.gpus, workers.use_gpu, workers.default_workers, workers.backend],
    "script": [cfg["num_workers"], cfg["use_gpu"]],
    "joined_nodes": len([n for n in ray.nodes() if n["Alive"]]),
}))
check_scaling(workers.default_workers, workers.use_gpu)   # the defaults fit the cluster
"""


@pytest.mark.slow
def test_defaults_come_from_the_workers_nodes_not_from_a_head_without_cpus_or_gpus(tmp_path):
    """deploy/cluster.yaml's shape: the head advertises no CPUs (no training there) and has no GPU; the worker
    node has the GPUs (here 2 logical ones; nothing runs on them). The driver, on the head's machine, sees
    no GPU: the notebooks' and scripts' defaults must still be one GPU worker per GPU of the cluster, with
    NCCL, and not two CPU workers with gloo."""
    head = ["--num-cpus=0", "--num-gpus=0"]
    gpu_worker = ["--num-cpus=2", "--num-gpus=2"]
    with local_cluster(tmp_path, head, gpu_worker) as (_address, env, nodes):
        assert sorted(nodes.values()) == [0, 2], nodes
        proc = subprocess.run([PY, "-c", DEFAULTS_PROBE, str(REPO / "solutions" / "07_scaling_up")],
                              capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env={**env, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "DEFAULTS " in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("DEFAULTS ", 1)[1].splitlines()[0])
    assert got["joined_nodes"] == 2, got                   # it joined the cluster, not a new local Ray
    assert got["driver"] == [0, "gloo"], got               # this machine: no GPU
    assert got["workers"] == [2, 2, True, 2, "nccl"], got  # the workers' node: 2 GPUs, so 2 GPU workers, NCCL
    assert got["script"] == [2, True], got
