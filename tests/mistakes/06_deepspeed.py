"""Realistic mistakes in module 06 (grade_id -> what a student might write)."""
WRONG = {
    # partitions the gradients already in stage 1 (stage 1 partitions only the optimizer state)
    "zero_bytes_per_rank": (
        "def zero_bytes_per_rank(num_params, world_size, stage):\n"
        "    if stage not in (0, 1, 2, 3):\n"
        "        raise ValueError(stage)\n"
        "    return {'params': 2 * num_params / (world_size if stage >= 3 else 1),\n"
        "            'grads': 2 * num_params / (world_size if stage >= 1 else 1),\n"
        "            'optimizer': 12 * num_params / (world_size if stage >= 1 else 1)}\n"),
    # micro batch vs global batch: treats the global batch as the per-worker micro batch
    "make_ds_config": (
        "def make_ds_config(stage, world_size, global_batch_size, micro_batch_size, lr,\n"
        "                   offload_optimizer=False, offload_param=False, bf16=False):\n"
        "    zero = {'stage': stage}\n"
        "    if offload_optimizer:\n"
        "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
        "    if offload_param:\n"
        "        zero['offload_param'] = {'device': 'cpu'}\n"
        "    return {'train_batch_size': micro_batch_size * world_size,\n"
        "            'train_micro_batch_size_per_gpu': micro_batch_size,\n"
        "            'gradient_accumulation_steps': global_batch_size // micro_batch_size,\n"
        "            'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
        "            'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
        "            'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"),
    # the DDP habit: only rank 0 saves (a collective in DeepSpeed) and reports a checkpoint
    "save_and_report": (
        "def save_and_report(engine, metrics, directory):\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        engine.save_checkpoint(directory, tag=TAG, client_state={'epoch': metrics['epoch']})\n"
        "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
        "    else:\n"
        "        ray.train.report(metrics, checkpoint=None)\n"),
}
