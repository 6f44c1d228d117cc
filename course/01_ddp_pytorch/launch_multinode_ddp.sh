#!/usr/bin/env bash
# Multi-node DDP with torchrun: run THIS SCRIPT ONCE ON EVERY NODE.
#
# Vanilla PyTorch has no cluster manager: you start the job on each machine
# yourself, and the copies find each other through node 0 (the "master").
# With 2 nodes of 4 GPUs each (8 processes, global ranks 0-7):
#
#   # on node 0 (its address, reachable from node 1, is 10.0.0.1):
#   NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch_multinode_ddp.sh --epochs 3
#   # on node 1, at about the same time (for example over ssh from node 0):
#   ssh node1 'cd /path/to/course/solutions/01_ddp_pytorch && \
#       NODE_RANK=1 MASTER_ADDR=10.0.0.1 ./launch_multinode_ddp.sh --epochs 3'
#
# What you must arrange by hand (Ray Train does all of it in module 02):
#   * the same code, Python environment and data path on every node;
#   * ssh (or a scheduler such as Slurm) to start the script on every node;
#   * MASTER_ADDR:MASTER_PORT open from every node to node 0 (firewalls!);
#   * SHARED STORAGE for --checkpoint-dir (NFS, /mnt/cluster_storage, ...):
#     only global rank 0 writes the checkpoint, on node 0's disk unless the
#     path is shared, and a restarted job on another node must find it;
#   * restarting everything yourself if any process dies: no fault tolerance.
#
# Settings (environment variables, or the flags in brackets):
#   NNODES          number of nodes                              [--nnodes]          default 2
#   NODE_RANK       0 on the master node, 1..NNODES-1 on others  [--node-rank]       required
#   NPROC_PER_NODE  processes on this node                       [--nproc-per-node]  default: GPUs here, else 1
#   MASTER_ADDR     address of node 0, reachable from all nodes  [--master-addr]     required
#   MASTER_PORT     a free TCP port on node 0                    [--master-port]     default 29500
#   PYTHON          the Python of the course environment                             default: python3
# Every other argument is passed through to train_ddp.py (--epochs, --smoke-test, ...).
#
# Try it on one machine: two "nodes" as two background processes on 127.0.0.1
#   NODE_RANK=0 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=1 ./launch_multinode_ddp.sh --smoke-test &
#   NODE_RANK=1 MASTER_ADDR=127.0.0.1 NPROC_PER_NODE=1 ./launch_multinode_ddp.sh --smoke-test
#   wait
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

PASSTHROUGH=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --nnodes)          NNODES="$2"; shift 2 ;;
        --node-rank)       NODE_RANK="$2"; shift 2 ;;
        --nproc-per-node)  NPROC_PER_NODE="$2"; shift 2 ;;
        --master-addr)     MASTER_ADDR="$2"; shift 2 ;;
        --master-port)     MASTER_PORT="$2"; shift 2 ;;
        --) shift; PASSTHROUGH+=("$@"); break ;;
        *)  PASSTHROUGH+=("$1"); shift ;;
    esac
done

if [[ -z "${PYTHON:-}" ]]; then
    PYTHON="$(command -v python3 || command -v python || true)"
fi
[[ -n "$PYTHON" ]] || { echo "error: no python found; set PYTHON=/path/to/venv/bin/python" >&2; exit 2; }

NNODES="${NNODES:-2}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NODE_RANK:-}" ]]; then
    echo "error: set NODE_RANK (0 on the master node, 1..$((NNODES - 1)) on the others)" >&2; exit 2
fi
if [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "error: set MASTER_ADDR to the address of node 0 (127.0.0.1 when every node rank runs on this machine)" >&2; exit 2
fi
if ! [[ "$NODE_RANK" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
    echo "error: NODE_RANK=$NODE_RANK must be an integer in 0..$((NNODES - 1))" >&2; exit 2
fi
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    # One process per GPU; a CPU-only node runs one process (gloo).
    NPROC_PER_NODE="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)"
    (( NPROC_PER_NODE > 0 )) || NPROC_PER_NODE=1
fi

echo "node ${NODE_RANK}/${NNODES}: ${NPROC_PER_NODE} process(es), master ${MASTER_ADDR}:${MASTER_PORT}," \
     "world size $((NNODES * NPROC_PER_NODE))" >&2

# Static rendezvous: node 0 hosts the store at MASTER_ADDR:MASTER_PORT, global
# rank = NODE_RANK * NPROC_PER_NODE + LOCAL_RANK. (Elastic alternative:
# --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=<job id>.)
exec "$PYTHON" -m torch.distributed.run \
    --nnodes="$NNODES" \
    --node-rank="$NODE_RANK" \
    --nproc-per-node="$NPROC_PER_NODE" \
    --master-addr="$MASTER_ADDR" \
    --master-port="$MASTER_PORT" \
    "$HERE/train_ddp.py" "${PASSTHROUGH[@]}"
