"""Realistic mistakes in module 05 (grade_id -> what a student might write)."""
WRONG = {
    # shards only the root: the whole model becomes one unit, gathered at once (no peak-memory saving)
    "setup_model_and_optimizer": (
        "def setup_model_and_optimizer(config, mesh, **fsdp_kwargs):\n"
        "    model = build_vit_from(config)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=config['lr'])\n"
        "    return model, optimizer\n"),
    # forgets that Adam keeps two moments per parameter
    "predict_rank_bytes": (
        "def predict_rank_bytes(num_params, world_size, strategy):\n"
        "    values = num_params if strategy == 'ddp' else math.ceil(num_params / world_size)\n"
        "    return {'params': 4 * values, 'grads': 4 * values, 'optimizer': 4 * values}\n"),
    # the DDP habit: only rank 0 saves (with DCP, a collective) and reports a checkpoint
    "save_and_report": (
        "def save_and_report(model, optimizer, metrics, directory):\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        model_state, optim_state = get_state_dict(model, optimizer)\n"
        "        dcp.save({'model': model_state, 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
        "                 checkpoint_id=directory)\n"
        "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
        "    else:\n"
        "        ray.train.report(metrics, checkpoint=None)\n"),
}
