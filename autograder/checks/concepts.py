"""The concept questions' keys: module -> grade_id -> (the expected letters, why, whether several letters
may be given). Never released: the notebooks hand in the answer (``coursekit.testing.record_answer``) and
``judge`` checks it here, in the grader's process."""
from __future__ import annotations

import contextlib
import io

from coursekit.testing.concepts import answer_problem, check_concept

KEYS: dict[str, dict[str, tuple[str, str, bool]]] = {
    '01_ddp_pytorch': {
        'test_concept_ddp_start': ('b', (
            "DDP's constructor broadcasts rank 0's parameters and buffers to every rank, so both ranks print rank "
            "0's sum after DDP(model). DDP never averages weights (it averages gradients, during backward), and "
            'it does not refuse replicas that differ: it makes them equal.'), False),
        'test_concept_sampler_seed': ('b', (
            'Each rank computes its own permutation and keeps every world_size-th index of it; only the same seed '
            '(and epoch) on every rank gives the same permutation, hence disjoint slices that cover the data. '
            'With seed=rank the two permutations differ: some examples land in both shards, others in neither. '
            'Nothing checks the seeds, and DDP still keeps the replicas identical (it averages the gradients).'), False),
        'test_concept_equal_shards': ('c', (
            "A collective waits until every rank of the group has joined it: rank 1's third all-reduce waits for "
            "rank 0, which has left its loop, until the process group's timeout, and the job fails. Nothing "
            'compares the batch counts beforehand, and an all-reduce never completes with fewer ranks than the '
            "group has. Equal shards (the sampler's padding, or DDP's join() for uneven inputs) keep the ranks in "
            'step.'), False),
        'test_concept_rank0_save': ('b', (
            'Every step all-reduces the gradients, so every rank applies the same averaged update to the same '
            'weights (made equal once, when DDP wrapped the model): weights and optimizer state stay identical '
            "whatever each rank's data, which is what data parallelism relies on. DDP copies rank 0's buffers "
            'before each forward, not its weights, and nothing needs gathering. Sharded strategies (FSDP2, '
            'ZeRO-3) differ: each rank holds a slice, so every rank saves its own.'), False),
    },
    '02_ray_train': {
        'test_concept_prepare_model': ('b', (
            'With one worker prepare_model only moves the model to the device (no DistributedDataParallel), so '
            "there is no .module: unwrap with getattr(model, 'module', model) or an isinstance check."), False),
        'test_concept_data_loader': ('c, d', (
            'It adds a DistributedSampler (keeping your shuffle) and moves batches to the device, but it keeps '
            'your batch_size per worker (2 workers x 4 = 8 numbers per step in the demo; 4 workers x 64 = 256 '
            "with a batch_size of 64) and never calls set_epoch (the demo's second epoch repeats the first): both "
            'are yours.'), True),
        'test_concept_report': ('c', (
            'Every worker must take part in every collective, the same number of times: DDP all-reduces the '
            "gradients in every step's backward, and ray.train.report is a barrier across all workers. Worker 2 "
            "never joins again, so the others block until the process group's timeout. Stop on a decision the "
            'workers share (all-reduce the validation loss, or a stop flag), so that they all leave the loop '
            'together.'), False),
        'test_concept_metrics_rows': ('c', (
            "In Train V2 only reports with a checkpoint are kept (4 here, with rank 0's metrics), and "
            'result.metrics_dataframe is built from CheckpointManager.best_checkpoint_results (the controller\'s '
            '_build_result): the num_to_keep best, epochs 9 and 14. The latest checkpoint (epoch 19) stays in '
            'storage and is result.checkpoint, but it has no row: 2 rows.'), False),
        'test_concept_shared_storage': ('b', (
            "Ray Train 2.60 writes a marker file into the run's folder when the run starts, from the driver's "
            'node (where its controller runs), and a worker looks for it only when it persists a checkpoint '
            "(StorageContext.persist_current_checkpoint -> _check_validation_file). Reports without a checkpoint "
            "touch no storage, so all 20 epochs train; rank 0's GPU node has its own /home/ray/results without the "
            "marker, so the last report raises 'Unable to set up cluster storage' and the run fails with the "
            'trained model unsaved. Use storage every node reaches: NFS, S3, GCS.'), False),
    },
    '03_ray_data': {
        'test_concept_cpu_split': ('c', (
            'Reserved CPUs are never lent: the placement group (as Ray Train reserves its workers, for the whole '
            "run) holds every CPU, so the map_batches tasks are submitted and never scheduled, and no block moves. "
            "Ray Data's NoProgressGuard counts the time since a block last entered or left an operator's queues (a "
            'task waiting for resources is no progress) and raises ExecutionTimeoutError after '
            'execution_no_progress_timeout_s: 10 s in the cell, 1,800 s by default, when a TorchTrainer run fails '
            "through its workers' shards. Ray Data does not check for free CPUs before it starts. Leave CPUs to "
            'Ray Data and cap Ray Data to them.'), False),
        'test_concept_uneven_rows': ('b', (
            'equal=True gives every worker the same number of rows by leaving up to N - 1 rows out of each epoch: '
            '1003 // 4 = 250 each, 3 left out. So every worker runs the same number of steps and reaches the same '
            'gradient all-reduces. DistributedSampler pads instead (rows read twice); nothing requires a multiple '
            'of the number of workers.'), False),
        'test_concept_streaming_memory': ('b', (
            'Streaming execution pipelines read -> preprocess -> train block by block; backpressure (within the '
            "DataContext's object-store budget) pauses the producers when the consumers lag, and consumed blocks "
            "are freed: the high-water mark stays below the store's size, and nothing spills. Nothing is "
            'compressed, the run does not fail, and a shard is an iterator, not a copy loaded up front: the data '
            'set can be far larger than memory.'), False),
        'test_concept_when_ray_data': ('c', (
            "The node's CPUs are the limit: 32 CPUs x (1 s / 2 ms) = 16,000 images per second at most, whatever "
            "the DataLoader's batch size or number of worker processes (8 per GPU is 64 processes sharing the "
            'same 32 CPUs). Only more CPUs help, and a DataLoader can only use the CPUs of its own node: Ray '
            "Data's map_batches tasks run on any node, so adding CPU-only nodes closes the gap (24,000 / 500 = 48 "
            'CPUs are needed).'), False),
    },
    '04_fault_tolerance': {
        'test_concept_rng_per_rank': ('b', (
            "DDP broadcasts parameters and buffers, never RNG states, and the sampler's order comes from its own "
            "seed and set_epoch: each rank's random stream is its own state, so a complete checkpoint holds one "
            'per rank.'), False),
        'test_concept_keep_latest': ('c', (
            'num_to_keep deletes the worst checkpoints except the latest one (storage holds epochs 3, 4 and 9), '
            'and a restart (or a rerun) always continues from the latest registered checkpoint; the best ones are '
            'for deployment.'), False),
        'test_concept_max_failures': ('b', (
            'Ray Train restarts the worker group as a whole, and counts one failure per restart however many of '
            'its workers failed; the count is per run and never resets (preemptions have their own budget).'), False),
        'test_concept_driver_restart': ('b', (
            'A run is identified by storage_path/name, and its snapshot lists the checkpoints it registered, with '
            "their metrics: the rerun restores it, so its Result lists the dead driver's registered checkpoints "
            'beside its own, every epoch once (with num_to_keep=None). It trains only the epochs after the latest '
            'registered one, so no epoch appears twice; a Result keeps one row per checkpoint it lists, not one '
            'in all. A new name would have been a new run, from epoch 0.'), False),
        'test_concept_asha': ('b, c', (
            'ASHA decides each trial when it reaches a rung, against what the trials before it reported there '
            '(the first always continues): arriving from worst to best every trial continues, from best to worst '
            'every one after the first is stopped. It never waits for the others.'), True),
    },
    '05_fsdp2': {
        'test_concept_root_only': ('b', (
            "the root unit's parameters are still Shard(0) DTensors, their gradients are reduce-scattered into "
            "shards and AdamW's moments follow the shards; but one unit is gathered whole for forward and "
            'backward, so the peak holds the full model, as under DDP (the measurement below shows it).'), False),
        'test_concept_reshard': ('b', (
            'Left unset, every block is resharded after its forward and gathered again before its backward (2 x 4 '
            '= 8), while FSDP2 keeps the root gathered from its forward to its backward (1): 9. With False every '
            'unit keeps its gathered weights from forward to backward: 5, at the cost of holding them all in '
            'between. 10 is True passed to every call, the root included.'), False),
        'test_concept_memory': ('b', (
            'FSDP2 shards the model state, 48 GB / N, so it shrinks as 1/N: 24 GB on 2 GPUs, 6 GB on 8; the '
            "activations belong to each rank's own micro-batch and are not sharded (40 GB on every rank), and the "
            'gathered weights are transient, one unit at a time. DDP keeps the whole 48 GB on every rank, so 48 + '
            '40 = 88 GB does not fit 80 GB on any number of GPUs.'), False),
        'test_concept_dcp': ('b', (
            'full_state_dict=True all-gathers every tensor on every rank before the save, so each rank held the '
            'whole model and optimizer (the peak FSDP2 exists to avoid); DCP then keeps one of the identical '
            "copies, so each tensor is written once, whole, by one rank, and the files' sizes look balanced: only "
            "the metadata's chunks show that nothing was sharded. (All in rank 0's file is what cpu_offload=True "
            'gives.)'), False),
        'test_concept_meta_peak': ('a', (
            'Once built, the three models are the same sharded model: the first step adds the same on every rank, '
            "the gradients of the rank's shards (F/2 on 2 ranks), AdamW's two moments, created lazily at the "
            'first step() (F), the activations and one gathered unit. Only the construction differs: eager above '
            'F on every rank, meta + init F/2, meta + load F/2 but rank 0 also holding the file.'), False),
    },
    '06_deepspeed': {
        'test_concept_zero2_full': ('c', (
            'ZeRO-2 partitions the optimizer state and the reduced gradients (14 bytes x 15 B / N) but every rank '
            'keeps all the bf16 parameters that forward and backward compute with: 2 bytes x 15 B = 30 GB, so 30 '
            '+ 210/N GB never goes below 30 GB. Only ZeRO-3 (or FSDP2) partitions the parameters.'), False),
        'test_concept_zero3_traffic': ('a', (
            'Each all-gather brings a rank the (N-1)/N of every layer it does not own, about Psi values per pass '
            'whatever N: two gathers and a reduce-scatter make about 3 x Psi per GPU per step on 8 GPUs as on 32, '
            'while the model state per GPU, 16 x Psi / N, shrinks. Memory scales with N; the communication per '
            'GPU does not shrink.'), False),
        'test_concept_bf16': ('a, b', (
            'bf16 has an 8-bit mantissa: an update much smaller than a weight would round away, so the optimizer '
            'updates an fp32 master copy with fp32 moments; forward and backward run on bf16 weights, and the '
            'logits and other activations are bf16 (half the memory and bandwidth). The run below your answer '
            'prints each dtype.'), True),
        'test_concept_offload': ('b', (
            'On a CPU-only machine the device memory is the host memory: offloading moves nothing out of the '
            'process, and DeepSpeed adds host buffers for the gradient partitions the CPU step reads (the table '
            'shows ZeRO-2 + offload holding more). On a GPU node the same setting moves the optimizer state and '
            'master weights out of GPU memory, paid for with PCIe copies and an optimizer step on the CPU every '
            'step.'), False),
        'test_concept_lost_partition': ('c', (
            "Under ZeRO-3 no rank holds a whole parameter: each rank's model-states file holds only placeholders "
            'for the partitioned parameters, and its optim-states file its partition of the fp32 master weights '
            "and of Adam's moments. With ranks 2 and 3 missing, half of every tensor is gone: neither "
            "load_checkpoint nor zero_to_fp32 can rebuild the model. (Under ZeRO-2, rank 0's model-states file "
            'would still hold the full weights.)'), False),
    },
    '07_scaling_up': {
        'test_concept_scaling_limits': ('a c', (
            "DDP's work per example does not change with scale (every GPU runs the whole model on its own batch); "
            'what grows is the gradient all-reduce (slower between nodes) and the wait for the slowest worker.'), True),
        'test_concept_when_to_shard': ('a c', (
            'Per rank, in fp32 with AdamW: DDP 16 bytes per parameter; ZeRO-2 keeps the whole parameters, 4 + (4 '
            '+ 12) / 4 = 8; ZeRO-3 (4 + 4 + 12) / 4 = 5; FSDP2 16 / 4 = 4. The budget is about 6 bytes per '
            'parameter, so on 4 ranks FSDP2 and ZeRO-3 fit, and on 2 ranks nothing does (FSDP2: 16 / 2 = 8).'), True),
        'test_concept_cluster_layout': ('a c', (
            'Resources only steer where Ray schedules tasks and actors: without use_gpu each worker asks for 1 '
            'CPU, which only the worker nodes offer, and nothing gives it a GPU, so Ray Train picks gloo and the '
            'CPU device. The driver is the process you start, wherever you start it.'), True),
        'test_concept_shared_storage': ('a', (
            'Ray Train 2.60 writes a marker file into the storage path when the run starts and checks for it '
            'before it persists a checkpoint (StorageContext._check_validation_file). With a sharded model every '
            'worker persists its shards, so the workers of the other node find no marker and the report raises '
            "'Unable to set up cluster storage': nothing lands silently on a node's disk. Use storage every node "
            'reaches (S3/GCS, NFS/EFS, /mnt/cluster_storage).'), False),
        'test_concept_job_submission': ('a c', (
            "ray job submit is a client: it uploads the working dir, asks the cluster to start the driver and then "
            'tails its logs, and Ctrl-C only ends the tail (the CLI does not stop the job). The driver runs on the '
            'head as a job the cluster supervises, and its output stays readable with ray job logs. The working '
            'dir is uploaded once, as a package every process of the job (restarted workers included) unpacks: an '
            'edit on your laptop reaches only a new job. FailureConfig restarts the worker group inside the same '
            'fit(); the driver is not restarted.'), True),
    },
}


def judge(module: str, grade_id: str, data: dict | None) -> tuple[bool, str]:
    """(passed, message) for a concept question's handed-in answer: its form (the visible check), then its
    letters against the key."""
    key, why, several = KEYS[module][grade_id]
    if data is None or "answer" not in data:
        return False, "no answer was handed in: run the question's cells (the answer cell, then its check) without errors"
    problem = answer_problem(data["answer"], several)
    if problem:
        return False, problem
    try:
        with contextlib.redirect_stdout(io.StringIO()):      # its "Right. ..." is the message returned here
            check_concept(data["answer"], key, why)
    except AssertionError as e:
        return False, str(e)
    return True, f"Right. {why}"
