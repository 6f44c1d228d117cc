"""Realistic mistakes in module 05 (grade_id -> what a student might write), and right answers written differently.

Every wrong answer below must lose all the points of its exercise's test cells, except the cells named with it
(``(code, [cells])``: cells that check something the mistake gets right); every RIGHT answer must keep them all.
"""
WRONG = {
    # shards only the root: the whole model becomes one unit, gathered at once (no peak-memory saving)
    # (its steps still equal one process: it keeps the training cell)
    "setup_fsdp": (
        "def setup_fsdp(config, device, **fsdp_kwargs):\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    model = build_vit_from(config)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    optimizer = torch.optim.AdamW(model.parameters(), lr=config['lr'])\n"
        "    return model, optimizer\n", ["test_setup_fsdp_training"]),
    # the DDP habit: every rank saves its shards (dcp.save is a collective), but only rank 0 reports a
    # checkpoint, so Ray Train's storage gets rank 0's shard and the metadata only (the save itself was sharded)
    "save_and_report": (
        "def save_and_report(model, optimizer, metrics, directory):\n"
        "    model_state, optim_state = get_state_dict(model, optimizer)\n"
        "    dcp.save({'model': model_state, 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
        "             checkpoint_id=directory)\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
        "    else:\n"
        "        ray.train.report(metrics, checkpoint=None)\n", ["test_save_and_report_sharded"]),
    # restores everything but returns the saved epoch: the run trains that epoch twice
    "restore_checkpoint": (
        "def restore_checkpoint(model, optimizer, checkpoint):\n"
        "    model_state, optim_state = get_state_dict(model, optimizer)\n"
        "    state = {'model': model_state, 'optimizer': optim_state, 'epoch': 0}\n"
        "    with checkpoint.as_directory() as d:\n"
        "        dcp.load(state, checkpoint_id=d)\n"
        "    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optimizer'])\n"
        "    return state['epoch']\n", ["test_restore_checkpoint_optimizer"]),
    # every rank writes the file: with cpu_offload the other ranks hold an empty dict, and on shared storage
    # they overwrite rank 0's file (rank 0's own file is right)
    "export_full_state_dict": (
        "def export_full_state_dict(model, directory):\n"
        "    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
        "    torch.save(state, os.path.join(directory, 'model_full.pt'))\n", ["test_export_full_state_dict_weights"]),
    # the whole model built eagerly on every rank, then sharded: right weights, but every rank held the whole model
    # (its fresh model and its loaded weights are right: it keeps those cells)
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    model = build_vit_from(config)\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    if weights_file is not None:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
        "    return model\n", ["test_build_on_meta", "test_build_on_meta_weights"]),
    # plain FSDP: a 1-D mesh over every rank of every node (right maths, every all-gather crosses nodes,
    # each rank holds 1/4 instead of its node's 1/2)
    "shard_hybrid": (
        "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
        "    mesh = init_device_mesh(device.type, (nodes * ranks_per_node,))\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh)\n"
        "    fully_shard(model, mesh=mesh)\n"
        "    return model\n",
        ["test_shard_hybrid_training", "test_shard_hybrid_device"]),
}

MORE_WRONG = [
    {
        # the optimizer is built before fully_shard: it holds the replaced parameters, the model never learns
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    model = build_vit_from(config)\n"
            "    optimizer = torch.optim.AdamW(model.parameters(), lr=config['lr'])\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, optimizer\n", ["test_setup_fsdp_options"]),
        # the DDP way on every rank: torch.save of the sharded state_dict, no DCP files or metadata
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(),\n"
            "                'epoch': metrics['epoch']}, os.path.join(directory, 'checkpoint.pt'))\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"),
        # restores the model only (dcp.load fills its sharded parameters in place): the optimizer keeps the new
        # run's state
        "restore_checkpoint": (
            "def restore_checkpoint(model, optimizer, checkpoint):\n"
            "    state = {'model': get_model_state_dict(model), 'epoch': 0}\n"
            "    with checkpoint.as_directory() as d:\n"
            "        dcp.load(state, checkpoint_id=d)\n"
            "    return state['epoch'] + 1\n", ["test_restore_checkpoint"]),
        # rank 0 saves its own sharded state_dict (DTensor shards) without gathering
        "export_full_state_dict": (
            "def export_full_state_dict(model, directory):\n"
            "    if dist.get_rank() == 0:\n"
            "        torch.save(model.state_dict(), os.path.join(directory, 'model_full.pt'))\n"),
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    with torch.device('meta'):\n"
        "        model = build_vit_from(config)\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    if weights_file is None:\n"
        "        torch.manual_seed(config['seed'])\n"
        "        for module in model.modules():\n"
        "            if hasattr(module, 'reset_parameters'):\n"
        "                module.reset_parameters()\n"
        "        with torch.no_grad():\n"
        "            model.cls_token.zero_()\n"
        "            model.pos_embed.normal_(0.0, 0.02)\n"
        "    else:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
        "    return model\n"),
        # the mesh's dimensions swapped, read as 'shard first': (ranks_per_node, nodes). On 2 nodes x 2 the mesh
        # is the same; on 4 nodes x 1 it shards over all 4 ranks, across nodes, instead of replicating
        "shard_hybrid": (
            "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
            "    mesh = init_device_mesh(device.type, (ranks_per_node, nodes), mesh_dim_names=('shard', 'replicate'))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh)\n"
            "    fully_shard(model, mesh=mesh)\n"
            "    return model\n",
            ["test_shard_hybrid_training", "test_shard_hybrid_device"]),
    },
    {
        # the options go to the root only: the blocks keep the defaults (fp32, resharded after forward)
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp", "test_setup_fsdp_training"]),
        # saves the model only: the optimizer's state is lost
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    dcp.save({'model': get_model_state_dict(model), 'epoch': metrics['epoch']}, checkpoint_id=directory)\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report_sharded"]),
        # loads into empty dicts: DCP fills only the keys it is given, so nothing reaches the model
        "restore_checkpoint": (
            "def restore_checkpoint(model, optimizer, checkpoint):\n"
            "    state = {'model': {}, 'optimizer': {}, 'epoch': 0}\n"
            "    with checkpoint.as_directory() as d:\n"
            "        dcp.load(state, checkpoint_id=d)\n"
            "    return state['epoch'] + 1\n"),
        # "rank 0" taken as the local rank: one file per node (ranks 0 and 2)
        "export_full_state_dict": (
            "def export_full_state_dict(model, directory):\n"
            "    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
            "    if int(os.environ.get('LOCAL_RANK', 0)) == 0:\n"
            "        torch.save(state, os.path.join(directory, 'model_full.pt'))\n",
            ["test_export_full_state_dict_weights"]),
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    with torch.device('meta'):\n"
        "        model = build_vit_from(config)\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    model.to_empty(device=device)\n"
        "    if weights_file is None:\n"
        "        torch.manual_seed(config['seed'])\n"
        "        for module in model.modules():\n"
        "            if hasattr(module, 'reset_parameters'):\n"
        "                module.reset_parameters()\n"
        "        with torch.no_grad():\n"
        "            model.cls_token.zero_()\n"
        "            model.pos_embed.normal_(0.0, 0.02)\n"
        "    else:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    if weights_file is not None:\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
        "    return model\n",
        ["test_build_on_meta", "test_build_on_meta_weights"]),
        # everything replicated (a shard dimension of 1): DDP's memory with FSDP2's machinery
        "shard_hybrid": (
            "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
            "    mesh = init_device_mesh(device.type, (nodes * ranks_per_node, 1), mesh_dim_names=('replicate', 'shard'))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh)\n"
            "    fully_shard(model, mesh=mesh)\n"
            "    return model\n",
            ["test_shard_hybrid_training", "test_shard_hybrid_device"]),
    },
    {
        # the workshop's mistake: a CUDA mesh written into the code (fails on every CPU worker)
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh('cuda', (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n"),
        # only rank 0 saves (DCP is a collective: the others never join) and reports
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    if ray.train.get_context().get_world_rank() == 0:\n"
            "        model_state, optim_state = get_state_dict(model, optimizer)\n"
            "        dcp.save({'model': model_state, 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
            "                 checkpoint_id=directory)\n"
            "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
            "    else:\n"
            "        ray.train.report(metrics, checkpoint=None)\n"),
        # the gather without cpu_offload and full_state_dict: the sharded DTensors end up in the file
        "export_full_state_dict": (
            "def export_full_state_dict(model, directory):\n"
            "    state = get_model_state_dict(model)\n"
            "    if dist.get_rank() == 0:\n"
            "        torch.save(state, os.path.join(directory, 'model_full.pt'))\n"),
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    with torch.device('meta'):\n"
        "        model = build_vit_from(config)\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    model.to_empty(device=device)\n"
        "    if weights_file is None:\n"
        "        torch.manual_seed(config['seed'])\n"
        "        for module in model.modules():\n"
        "            if hasattr(module, 'reset_parameters'):\n"
        "                module.reset_parameters()\n"
        "    else:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
        "    return model\n",
        ["test_build_on_meta_weights", "test_build_on_meta_memory"]),
        # sharded on the node's sub-mesh only: no all-reduce across nodes, each node trains on its own half
        "shard_hybrid": (
            "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
            "    mesh = init_device_mesh(device.type, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh['shard'])\n"
            "    fully_shard(model, mesh=mesh['shard'])\n"
            "    return model\n",
            ["test_shard_hybrid_device"]),
    },
    {
        # a CPU mesh written into the code: passes on a CPU-only machine, fails on every GPU worker
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh('cpu', (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp_options", "test_setup_fsdp_training"]),
        # every rank gathers the full model and optimizer first, then saves with DCP: it runs and loads back, but
        # nothing is sharded (each tensor saved whole) and every rank held everything in memory
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    options = StateDictOptions(full_state_dict=True)\n"
            "    model_state, optim_state = get_state_dict(model, optimizer, options=options)\n"
            "    dcp.save({'model': model_state, 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
            "             checkpoint_id=directory)\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report"]),
        # only rank 0 gathers: the other ranks never join the collective (rank 0 waits for them)
        "export_full_state_dict": (
            "def export_full_state_dict(model, directory):\n"
            "    if dist.get_rank() == 0:\n"
            "        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
            "        torch.save(state, os.path.join(directory, 'model_full.pt'))\n"),
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    with torch.device('meta'):\n"
        "        model = build_vit_from(config)\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    model.to_empty(device=device)\n"
        "    if weights_file is None:\n"
        "        torch.manual_seed(config['seed'])\n"
        "        for module in model.modules():\n"
        "            if hasattr(module, 'reset_parameters'):\n"
        "                module.reset_parameters()\n"
        "        with torch.no_grad():\n"
        "            model.cls_token.zero_()\n"
        "            model.pos_embed.normal_(0.0, 0.02)\n"
        "    else:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True)\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))\n"
        "    return model\n",
        ["test_build_on_meta", "test_build_on_meta_weights"]),
        # the mesh's device type written as a string: right on this CPU machine, a CPU mesh on a GPU worker
        "shard_hybrid": (
            "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
            "    mesh = init_device_mesh('cpu', (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh)\n"
            "    fully_shard(model, mesh=mesh)\n"
            "    return model\n",
            ["test_shard_hybrid", "test_shard_hybrid_training"]),
    },
    {
        # the mesh over this node's workers only (local world size): 2 ranks of a 4-rank job
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    local = ray.train.get_context().get_local_world_size()\n"
            "    mesh = init_device_mesh(device.type, (local,))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n"),
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    with torch.device('meta'):\n"
        "        model = build_vit_from(config)\n"
        "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
        "    for block in model.blocks:\n"
        "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
        "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    model.to_empty(device=device)\n"
        "    if weights_file is None:\n"
        "        torch.manual_seed(config['seed'])\n"
        "        for module in model.modules():\n"
        "            if hasattr(module, 'reset_parameters'):\n"
        "                module.reset_parameters()\n"
        "        with torch.no_grad():\n"
        "            model.cls_token.zero_()\n"
        "            model.pos_embed.normal_(0.0, 0.02)\n"
        "    else:\n"
        "        full = torch.load(weights_file, map_location='cpu', weights_only=True)\n"
        "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
        "    return model\n",
        ["test_build_on_meta", "test_build_on_meta_weights"]),
    },
    {
        # the options go to the blocks only: the root (patch embedding, head) computes in fp32
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp", "test_setup_fsdp_training"]),
        # Exercise 4's gather used for the checkpoint: the full state dicts gathered into rank 0's CPU memory
        # (cpu_offload=True), then saved with DCP: everything lands in rank 0's file, nothing is sharded
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    model_state, optim_state = get_state_dict(\n"
            "        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))\n"
            "    dcp.save({'model': model_state, 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
            "             checkpoint_id=directory)\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report"]),
    },
    {
        # "bf16 training" read as bf16 weights: the model is cast to the policy's dtype before sharding, so the
        # sharded master weights that AdamW updates are bf16 (small updates round away)
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    policy = fsdp_kwargs.get('mp_policy')\n"
            "    if policy is not None and policy.param_dtype is not None:\n"
            "        model = model.to(policy.param_dtype)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp", "test_setup_fsdp_training"]),
    },
    {
        # the PyTorch tutorial's fully_shard(module) with no mesh: FSDP2 then builds its own on the machine's
        # accelerator (cuda on a GPU node, where the notebook's CPU ranks fail); right on this CPU machine
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, **fsdp_kwargs)\n"
            "    fully_shard(model, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp_options", "test_setup_fsdp_training"]),
        # the checkpoint's path read as a local folder: right for a local checkpoint, not for one in cloud storage
        "restore_checkpoint": (
            "def restore_checkpoint(model, optimizer, checkpoint):\n"
            "    model_state, optim_state = get_state_dict(model, optimizer)\n"
            "    state = {'model': model_state, 'optimizer': optim_state, 'epoch': 0}\n"
            "    dcp.load(state, checkpoint_id=checkpoint.path)\n"
            "    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optimizer'])\n"
            "    return state['epoch'] + 1\n"),
        # full_state_dict without cpu_offload: every rank gathers the whole model and keeps it (on a GPU worker, in
        # GPU memory), then rank 0 saves its copy: the file is right
        "export_full_state_dict": (
            "def export_full_state_dict(model, directory):\n"
            "    from pathlib import Path\n"
            "    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
            "    state = {k: v.cpu() for k, v in state.items()}\n"
            "    if ray.train.get_context().get_world_rank() == 0:\n"
            "        torch.save(state, Path(directory) / 'model_full.pt')\n",
            ["test_export_full_state_dict"]),
        # the ViT built by hand and never seeded (build_vit_from would have seeded it): every value initialised and
        # within its distribution, but another model on every run
        "build_on_meta": (
            "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
            "    with torch.device('meta'):\n"
            "        model = ViT(depth=config['depth'], width=config['width'], heads=config['heads'], patch=config['patch'])\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    model.to_empty(device=device)\n"
            "    if weights_file is None:\n"
            "        for module in model.modules():\n"
            "            if hasattr(module, 'reset_parameters'):\n"
            "                module.reset_parameters()\n"
            "        with torch.no_grad():\n"
            "            model.cls_token.zero_()\n"
            "            model.pos_embed.normal_(0.0, 0.02)\n"
            "    else:\n"
            "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
            "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
            "    return model\n",
            ["test_build_on_meta_weights", "test_build_on_meta_memory"]),
    },
    {
        # the model's shards, but the optimizer gathered whole: every rank writes every optimizer tensor
        "save_and_report": (
            "def save_and_report(model, optimizer, metrics, directory):\n"
            "    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\n"
            "    optim_state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))\n"
            "    dcp.save({'model': get_model_state_dict(model), 'optimizer': optim_state, 'epoch': metrics['epoch']},\n"
            "             checkpoint_id=directory)\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report"]),
        # a restore through full state dicts on every rank: the right values, but every rank reads and holds
        # the whole model and optimizer
        "restore_checkpoint": (
            "def restore_checkpoint(model, optimizer, checkpoint):\n"
            "    options = StateDictOptions(full_state_dict=True)\n"
            "    model_state, optim_state = get_state_dict(model, optimizer, options=options)\n"
            "    state = {'model': model_state, 'optimizer': optim_state, 'epoch': 0}\n"
            "    with checkpoint.as_directory() as d:\n"
            "        dcp.load(state, checkpoint_id=d)\n"
            "    set_state_dict(model, optimizer, model_state_dict=state['model'], optim_state_dict=state['optimizer'],\n"
            "                   options=options)\n"
            "    return state['epoch'] + 1\n"),
        # to_empty before the root's fully_shard: the blocks' shards and the root's whole parameters (patch
        # embedding, tokens, head) allocated before the root is sharded (about 1% of this model: below any bound)
        "build_on_meta": (
            "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
            "    with torch.device('meta'):\n"
            "        model = build_vit_from(config)\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    model.to_empty(device=device)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    if weights_file is None:\n"
            "        torch.manual_seed(config['seed'])\n"
            "        for module in model.modules():\n"
            "            if hasattr(module, 'reset_parameters'):\n"
            "                module.reset_parameters()\n"
            "        with torch.no_grad():\n"
            "            model.cls_token.zero_()\n"
            "            model.pos_embed.normal_(0.0, 0.02)\n"
            "    else:\n"
            "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
            "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
            "    return model\n",
            ["test_build_on_meta", "test_build_on_meta_weights"]),
    },
    {
        # the last block left in the root's unit: gathered with the root, two blocks' weights at once
        "setup_fsdp": (
            "def setup_fsdp(config, device, **fsdp_kwargs):\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    model = build_vit_from(config)\n"
            "    for block in model.blocks[:-1]:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
            "    return model, torch.optim.AdamW(model.parameters(), lr=config['lr'])\n",
            ["test_setup_fsdp_training"]),
        # dcp.load fills the sharded state dicts in place, so the model and the momentum come back; the
        # optimizer's param_groups (its lr, as a schedule left it) only through set_state_dict
        "restore_checkpoint": (
            "def restore_checkpoint(model, optimizer, checkpoint):\n"
            "    model_state, optim_state = get_state_dict(model, optimizer)\n"
            "    state = {'model': model_state, 'optimizer': optim_state, 'epoch': 0}\n"
            "    with checkpoint.as_directory() as d:\n"
            "        dcp.load(state, checkpoint_id=d)\n"
            "    return state['epoch'] + 1\n", ["test_restore_checkpoint"]),
        # the options to the blocks only: the root (patch embedding, head) keeps fp32 and resharding
        "build_on_meta": (
            "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
            "    with torch.device('meta'):\n"
            "        model = build_vit_from(config)\n"
            "    mesh = init_device_mesh(device.type, (dist.get_world_size(),))\n"
            "    for block in model.blocks:\n"
            "        fully_shard(block, mesh=mesh, **fsdp_kwargs)\n"
            "    fully_shard(model, mesh=mesh)\n"
            "    model.to_empty(device=device)\n"
            "    if weights_file is None:\n"
            "        torch.manual_seed(config['seed'])\n"
            "        for module in model.modules():\n"
            "            if hasattr(module, 'reset_parameters'):\n"
            "                module.reset_parameters()\n"
            "        with torch.no_grad():\n"
            "            model.cls_token.zero_()\n"
            "            model.pos_embed.normal_(0.0, 0.02)\n"
            "    else:\n"
            "        full = torch.load(weights_file, map_location='cpu', weights_only=True) if dist.get_rank() == 0 else {}\n"
            "        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))\n"
            "    return model\n",
            ["test_build_on_meta_weights", "test_build_on_meta_memory"]),
    },
]

RIGHT = {
    # Ray Train's context for the world size, keyword arguments, the model built on the device first
    # (fully_shard would move it anyway), the blocks by index, weight decay and betas of its own
    "setup_fsdp": (
        "def setup_fsdp(config, device, **fsdp_kwargs):\n"
        "    world = ray.train.get_context().get_world_size()\n"
        "    mesh = init_device_mesh(device_type=device.type, mesh_shape=(world,))\n"
        "    model = build_vit_from(config).to(device)\n"
        "    for i in range(len(model.blocks)):\n"
        "        fully_shard(model.blocks[i], mesh=mesh, **fsdp_kwargs)\n"
        "    model = fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    params = [p for p in model.parameters() if p.requires_grad]\n"
        "    optimizer = torch.optim.AdamW(params, lr=config['lr'], weight_decay=0.01)\n"
        "    return model, optimizer\n"),
    # the model's and the optimizer's state dicts fetched separately, Ray's rank from the context
    "save_and_report": (
        "def save_and_report(model, optimizer, metrics, directory):\n"
        "    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict\n"
        "    state = {'model': get_model_state_dict(model),\n"
        "             'optimizer': get_optimizer_state_dict(model, optimizer),\n"
        "             'epoch': int(metrics['epoch'])}\n"
        "    torch.distributed.checkpoint.save(state_dict=state, checkpoint_id=directory)\n"
        "    checkpoint = ray.train.Checkpoint.from_directory(directory)\n"
        "    ray.train.report(metrics=metrics, checkpoint=checkpoint)\n"),
    # the path of the checkpoint directly, the model's and optimizer's setters separately
    "restore_checkpoint": (
        "def restore_checkpoint(model, optimizer, checkpoint):\n"
        "    from torch.distributed.checkpoint.state_dict import (\n"
        "        get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict)\n"
        "    state = {'model': get_model_state_dict(model),\n"
        "             'optimizer': get_optimizer_state_dict(model, optimizer), 'epoch': -100}\n"
        "    with checkpoint.as_directory() as checkpoint_dir:\n"
        "        dcp.load(state_dict=state, checkpoint_id=checkpoint_dir)\n"
        "    set_model_state_dict(model, state['model'])\n"
        "    set_optimizer_state_dict(model, optimizer, state['optimizer'])\n"
        "    return int(state['epoch']) + 1\n"),
    # Ray Train's world rank, pathlib, keywords, the options in the other order, the empty dict of the other ranks
    # tested instead of the rank
    "export_full_state_dict": (
        "def export_full_state_dict(model, directory):\n"
        "    from pathlib import Path\n"
        "    state = get_model_state_dict(model=model, options=StateDictOptions(cpu_offload=True, full_state_dict=True))\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        torch.save(obj=state, f=Path(directory) / 'model_full.pt')\n"),
    # torchtitan's order: always initialise, then let the loaded weights overwrite; ViT by hand inside the meta
    # device, blocks by index, model.apply, nn.init's zeros_ and trunc_normal_, the file memory-mapped on rank 0
    "build_on_meta": (
        "def build_on_meta(config, device, weights_file=None, **fsdp_kwargs):\n"
        "    from torch.distributed.checkpoint.state_dict import set_model_state_dict as load_into\n"
        "    with torch.device('meta'):\n"
        "        model = ViT(depth=config['depth'], width=config['width'], heads=config['heads'], patch=config['patch'])\n"
        "    mesh = init_device_mesh(device_type=device.type, mesh_shape=(dist.get_world_size(),))\n"
        "    for i in range(len(model.blocks)):\n"
        "        fully_shard(model.blocks[i], mesh=mesh, **fsdp_kwargs)\n"
        "    model = fully_shard(model, mesh=mesh, **fsdp_kwargs)\n"
        "    host = type(fsdp_kwargs.get('offload_policy')).__name__ == 'CPUOffloadPolicy'\n"
        "    model = model.to_empty(device=torch.device('cpu') if host else device)\n"
        "    torch.manual_seed(config['seed'])\n"
        "    model.apply(lambda m: m.reset_parameters() if hasattr(m, 'reset_parameters') else None)\n"
        "    with torch.no_grad():\n"
        "        torch.nn.init.zeros_(model.cls_token)\n"
        "        torch.nn.init.trunc_normal_(model.pos_embed, std=0.02)\n"
        "    if weights_file:\n"
        "        state = {}\n"
        "        if dist.get_rank() == 0:\n"
        "            state = torch.load(weights_file, map_location='cpu', weights_only=True, mmap=True)\n"
        "        load_into(model=model, model_state_dict=state,\n"
        "                  options=StateDictOptions(broadcast_from_rank0=True, full_state_dict=True))\n"
        "    return model\n"),
    # the init_device_mesh imported under another name, keywords, names of its own, blocks by index, the root
    # returned by fully_shard
    "shard_hybrid": (
        "def shard_hybrid(model, device, nodes, ranks_per_node):\n"
        "    from torch.distributed.device_mesh import init_device_mesh as make_mesh\n"
        "    hsdp_mesh = make_mesh(device_type=device.type, mesh_shape=(nodes, ranks_per_node),\n"
        "                          mesh_dim_names=('dp_replicate', 'dp_shard'))\n"
        "    for i in range(len(model.blocks)):\n"
        "        fully_shard(model.blocks[i], mesh=hsdp_mesh, reshard_after_forward=True)\n"
        "    return fully_shard(model, mesh=hsdp_mesh)\n"),
}
