"""Realistic mistakes in module 06 (grade_id -> what a student might write).

WRONG is one student with a mistake in every code exercise (partial credit: the concept questions and nothing
else); each MORE_WRONG dict is one more student; RIGHT answers every exercise correctly but differently from the
reference (full marks). A mistake written as ``(code, [cells])`` keeps the points of those test cells (they check
something it gets right) and must lose all the others of its exercise. Note: DeepSpeed 0.19 supports `loss.backward()` on a loss computed from `engine(x)` (it
hooks the engine's output and scales by the accumulation steps), so that is not a mistake here; computing the
forward pass with `engine.module` is (ZeRO-3 trains differently).
"""
WRONG = {
    # the DDP habit: one worker's batch is the global batch / world size, so no accumulation (micro 12, not 6)
    "build_engine": (
        "def build_engine(model, world_size, global_batch_size, micro_batch_size, lr, stage,\n"
        "                 offload_optimizer=False, bf16=False):\n"
        "    zero = {'stage': stage}\n"
        "    if offload_optimizer:\n"
        "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
        "    config = {'train_batch_size': global_batch_size,\n"
        "              'train_micro_batch_size_per_gpu': global_batch_size // world_size,\n"
        "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
        "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
        "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
        "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
        "    return engine\n"),
    # divides the loss by the accumulation steps itself: engine.backward does it already (gradients halved)
    "train_micro_batches": (
        "def train_micro_batches(engine, batches):\n"
        "    losses = []\n"
        "    for images, labels in batches:\n"
        "        loss = F.cross_entropy(engine(images), labels) / engine.gradient_accumulation_steps()\n"
        "        engine.backward(loss)\n"
        "        engine.step()\n"
        "        losses.append(loss.item())\n"
        "    return sum(losses) / len(losses)\n"),
    # the DDP habit: only rank 0 saves (a collective in DeepSpeed: the others never join) and reports a checkpoint
    "save_and_report": (
        "def save_and_report(engine, metrics, directory):\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        engine.save_checkpoint(directory, tag=TAG, client_state={'epoch': metrics['epoch']})\n"
        "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
        "    else:\n"
        "        ray.train.report(metrics, checkpoint=None)\n"),
    # continues at the saved epoch (trains it twice)
    "restore_checkpoint": (
        "def restore_checkpoint(engine, checkpoint):\n"
        "    with checkpoint.as_directory() as directory:\n"
        "        _, client_state = engine.load_checkpoint(directory)\n"
        "    return client_state['epoch']\n", ["test_restore_checkpoint_optimizer"]),
}

_CONFIG_HEAD = (
    "def build_engine(model, world_size, global_batch_size, micro_batch_size, lr, stage,\n"
    "                 offload_optimizer=False, bf16=False):\n")

MORE_WRONG = [
    {
        # the config block is built but never used: the stage and offload go into a copy, the engine runs stage 0
        "build_engine": (_CONFIG_HEAD +
            "    ds_config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "                 'gradient_accumulation_steps': global_batch_size // (micro_batch_size * world_size),\n"
            "                 'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "                 'zero_optimization': {'stage': 0}, 'zero_force_ds_cpu_optimizer': False,\n"
            "                 'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    zero = dict(ds_config['zero_optimization'])\n"
            "    zero['stage'] = stage\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)\n"
            "    return engine\n", ["test_build_engine_training"]),   # stage 0 trains like DDP too
        # the optimizer stepped by hand, outside the engine (every micro-batch, and past ZeRO's bookkeeping)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    losses = []\n"
            "    for images, labels in batches:\n"
            "        loss = F.cross_entropy(engine(images), labels)\n"
            "        engine.backward(loss)\n"
            "        engine.optimizer.step()\n"
            "        engine.optimizer.zero_grad()\n"
            "        losses.append(loss.item())\n"
            "    return sum(losses) / len(losses)\n"),
        # node-local habit: the first worker of each node saves and reports (ranks 0 and 2 of 2 nodes x 2)
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    if ray.train.get_context().get_local_rank() == 0:\n"
            "        engine.save_checkpoint(directory, tag=TAG, client_state={'epoch': metrics['epoch']})\n"
            "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
            "    else:\n"
            "        ray.train.report(metrics)\n"),
        # restores the weights only: Adam's moments start from zero again
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    with checkpoint.as_directory() as directory:\n"
            "        _, client_state = engine.load_checkpoint(directory, load_module_only=True)\n"
            "    return client_state['epoch'] + 1\n", ["test_restore_checkpoint"]),
    },
    {
        # accumulation ignored: the accumulation steps computed without the world size (DeepSpeed refuses 24 != 6 x 4 x 2)
        "build_engine": (_CONFIG_HEAD +
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'gradient_accumulation_steps': global_batch_size // micro_batch_size,\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n"),
        # steps the engine only at the end of each accumulation window (the engine then never sees the window end)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    losses = []\n"
            "    for i, (images, labels) in enumerate(batches):\n"
            "        loss = F.cross_entropy(engine(images), labels)\n"
            "        engine.backward(loss)\n"
            "        if (i + 1) % engine.gradient_accumulation_steps() == 0:\n"
            "            engine.step()\n"
            "        losses.append(loss.item())\n"
            "    return sum(losses) / len(losses)\n"),
        # every rank saves, but only rank 0 reports a checkpoint: ranks 1-3's partitions never reach storage
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    engine.save_checkpoint(directory, tag=TAG, client_state={'epoch': metrics['epoch']})\n"
            "    if ray.train.get_context().get_world_rank() == 0:\n"
            "        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
            "    else:\n"
            "        ray.train.report(metrics)\n"),
        # only rank 0 restores (the DDP habit): rank 1 keeps the new run's weights
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    epoch = 0\n"
            "    if ray.train.get_context().get_world_rank() == 0:\n"
            "        with checkpoint.as_directory() as directory:\n"
            "            _, client_state = engine.load_checkpoint(directory)\n"
            "        epoch = client_state['epoch'] + 1\n"
            "    return epoch\n"),
    },
    {
        # copied the module-07 habit of turning clipping off: the engine takes clipping 0 (Adam's normalised steps
        # hide it in 3 steps of training, the engine's settings show it)
        "build_engine": (_CONFIG_HEAD +
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False, 'gradient_clipping': 0.0,\n"
            "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n"),
        # the forward pass through the wrapped module, not the engine (ZeRO-3 then trains differently: hidden test)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    losses = []\n"
            "    for images, labels in batches:\n"
            "        loss = F.cross_entropy(engine.module(images), labels)\n"
            "        engine.backward(loss)\n"
            "        engine.step()\n"
            "        losses.append(loss.item())\n"
            "    return sum(losses) / len(losses)\n", ["test_train_micro_batches", "test_train_micro_batches_bf16"]),
        # reports before saving: the reported directory is still empty (hidden test)
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"
            "    engine.save_checkpoint(directory, tag=TAG, client_state={'epoch': metrics['epoch']})\n"),
        # does not restore the optimizer state
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    with checkpoint.as_directory() as directory:\n"
            "        _, client_state = engine.load_checkpoint(directory, load_optimizer_states=False)\n"
            "    return client_state['epoch'] + 1\n", ["test_restore_checkpoint"]),
    },
    {
        # bf16 and offload never reach the config (visible check passes, hidden test fails)
        "build_engine": (_CONFIG_HEAD +
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'gradient_accumulation_steps': global_batch_size // (micro_batch_size * world_size),\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "              'zero_optimization': {'stage': stage}, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n", ["test_build_engine_training"]),
        # returns what engine.backward returns: the loss already divided by the accumulation steps (hidden test)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    total, count = 0.0, 0\n"
            "    for images, labels in batches:\n"
            "        loss = engine.backward(F.cross_entropy(engine(images), labels))\n"
            "        engine.step()\n"
            "        total, count = total + loss.item(), count + 1\n"
            "    return total / count\n", ["test_train_micro_batches", "test_train_micro_batches_zero3"]),
        # a tag per rank: the ranks' files land under different tags, `latest` names rank 0's only (hidden test)
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    rank = ray.train.get_context().get_world_rank()\n"
            "    engine.save_checkpoint(directory, tag=f'epoch{metrics[\"epoch\"]}-rank{rank}',\n"
            "                           client_state={'epoch': metrics['epoch']})\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n"),
        # the next epoch from the optimizer step count, not from the saved epoch
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    with checkpoint.as_directory() as directory:\n"
            "        engine.load_checkpoint(directory)\n"
            "    return engine.global_steps + 1\n", ["test_restore_checkpoint_optimizer"]),
    },
    {
        # the learning rate never reaches the optimizer (DeepSpeed's default 1e-3 is used)
        "build_engine": (_CONFIG_HEAD +
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'torch_adam': True}},\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n"),
        # one engine.step() after all micro-batches (the engine then sees a single micro-batch)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    losses = []\n"
            "    for images, labels in batches:\n"
            "        loss = F.cross_entropy(engine(images), labels)\n"
            "        engine.backward(loss)\n"
            "        losses.append(loss.item())\n"
            "    engine.step()\n"
            "    return sum(losses) / len(losses)\n"),
        # forgets client_state: the epoch is not in the checkpoint (hidden test)
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    engine.save_checkpoint(directory, tag=TAG)\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report", "test_save_and_report_resume"]),
        # the checkpoint's path taken for a folder: right for a local checkpoint, but in cloud storage the path is
        # inside the bucket ('course-bucket/...'), and load_checkpoint finds nothing there
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    _, client_state = engine.load_checkpoint(checkpoint.path)\n"
            "    return client_state['epoch'] + 1\n"),
    },
    {
        # the loss computed in the engine's precision: under bf16 the logits are bf16 and so is the loss, which
        # keeps about 3 significant digits (fp32 engines: right; the bf16 engine of the hidden test: wrong loss and
        # gradients)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    losses = []\n"
            "    for images, labels in batches:\n"
            "        loss = F.cross_entropy(engine(images), labels)\n"
            "        engine.backward(loss)\n"
            "        engine.step()\n"
            "        losses.append(loss.item())\n"
            "    return sum(losses) / len(losses)\n",
            ["test_train_micro_batches", "test_train_micro_batches_zero3", "test_train_micro_batches_loss"]),
        # half precision read as fp16: the bf16 flag switches on fp16 (the engine reports no bf16; fp32 runs are right)
        "build_engine": (_CONFIG_HEAD +
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'gradient_accumulation_steps': global_batch_size // (micro_batch_size * world_size),\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'fp16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n", ["test_build_engine_training"]),
        # the tag left out: DeepSpeed's default, 'global_step<N>', not TAG (the checkpoint still loads through
        # `latest`)
        "save_and_report": (
            "def save_and_report(engine, metrics, directory):\n"
            "    engine.save_checkpoint(directory, client_state={'epoch': metrics['epoch']})\n"
            "    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(directory))\n",
            ["test_save_and_report_resume", "test_save_and_report_epoch"]),
    },
    {
        # the running total in a tensor made on the CPU (no device): right on a CPU, but on a GPU worker the loss is
        # on the GPU and the in-place add raises (the check's stand-in device shows it)
        "train_micro_batches": (
            "def train_micro_batches(engine, batches):\n"
            "    total, count = torch.zeros(()), 0\n"
            "    for images, labels in batches:\n"
            "        loss = F.cross_entropy(engine(images).float(), labels)\n"
            "        engine.backward(loss)\n"
            "        engine.step()\n"
            "        total += loss.detach()\n"
            "        count += 1\n"
            "    return (total / count).item()\n",
            ["test_train_micro_batches", "test_train_micro_batches_zero3", "test_train_micro_batches_bf16"]),
        # a torch Adam handed to initialize: an L2 penalty of 0, not AdamW's decoupled weight decay of 0.01 (after 3
        # steps the weights are within 2% of AdamW's; the engine's optimizer shows it)
        "build_engine": (_CONFIG_HEAD +
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'gradient_accumulation_steps': global_batch_size // (micro_batch_size * world_size),\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=lr),\n"
            "                                      config=config)\n"
            "    return engine\n"),
        # `latest` taken for the tag: load_checkpoint looks for a folder named latest (the tag is written in that file)
        "restore_checkpoint": (
            "def restore_checkpoint(engine, checkpoint):\n"
            "    with checkpoint.as_directory() as directory:\n"
            "        _, client_state = engine.load_checkpoint(directory, tag='latest')\n"
            "    return client_state['epoch'] + 1\n"),
    },
    {
        # "ZeRO-Offload needs ZeRO-3": the stage raised to 3 whenever offload is asked (right at stage 3, and
        # without offload; at ZeRO-2 the engine runs another stage)
        "build_engine": (_CONFIG_HEAD +
            "    if offload_optimizer:\n"
            "        stage = 3\n"
            "    zero = {'stage': stage}\n"
            "    if offload_optimizer:\n"
            "        zero['offload_optimizer'] = {'device': 'cpu'}\n"
            "    config = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
            "              'gradient_accumulation_steps': global_batch_size // (micro_batch_size * world_size),\n"
            "              'optimizer': {'type': 'AdamW', 'params': {'lr': lr, 'torch_adam': True}},\n"
            "              'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False,\n"
            "              'bf16': {'enabled': bf16}, 'steps_per_print': 10**9}\n"
            "    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)\n"
            "    return engine\n", ["test_build_engine_training"]),
    },
]

RIGHT = {
    # no gradient_accumulation_steps (DeepSpeed derives it), a torch optimizer handed to initialize, clipping explicit
    "build_engine": (
        "def build_engine(model, world_size, global_batch_size, micro_batch_size, lr, stage,\n"
        "                 offload_optimizer=False, bf16=False):\n"
        "    zero = {'stage': stage, **({'offload_optimizer': {'device': 'cpu'}} if offload_optimizer else {})}\n"
        "    cfg = {'train_batch_size': global_batch_size, 'train_micro_batch_size_per_gpu': micro_batch_size,\n"
        "           'zero_optimization': zero, 'zero_force_ds_cpu_optimizer': False, 'gradient_clipping': 1.0,\n"
        "           'bf16': {'enabled': bool(bf16)}, 'steps_per_print': 1_000_000_000}\n"
        "    params = list(model.parameters())\n"
        "    result = deepspeed.initialize(model=model, model_parameters=params,\n"
        "                                  optimizer=torch.optim.AdamW(params, lr=lr), config=cfg)\n"
        "    return result[0]\n"),
    # the mean over all ranks (what the training function reports anyway), accumulated on the engine's device
    "train_micro_batches": (
        "def train_micro_batches(engine, batches):\n"
        "    values = []\n"
        "    for step, (x, y) in enumerate(batches):\n"
        "        out = engine(x)\n"
        "        loss = torch.nn.functional.cross_entropy(out.to(torch.float32), y)\n"
        "        engine.backward(loss)\n"
        "        engine.step()\n"
        "        values.append(loss.detach())\n"
        "    mean = torch.stack(values).mean().to(engine.device)\n"
        "    torch.distributed.all_reduce(mean)\n"
        "    return mean.item() / torch.distributed.get_world_size()\n"),
    "save_and_report": (
        "def save_and_report(engine, metrics, directory):\n"
        "    epoch = metrics['epoch']\n"
        "    engine.save_checkpoint(save_dir=directory, tag=TAG, client_state=dict(epoch=epoch))\n"
        "    checkpoint = ray.train.Checkpoint(path=directory)\n"
        "    ray.train.report(metrics=dict(metrics), checkpoint=checkpoint)\n"),
    "restore_checkpoint": (
        "def restore_checkpoint(engine, checkpoint):\n"
        "    with checkpoint.as_directory() as path:\n"
        "        loaded_path, state = engine.load_checkpoint(path, tag=TAG, load_optimizer_states=True)\n"
        "    assert loaded_path is not None, 'nothing was loaded'\n"
        "    return int(state['epoch']) + 1\n"),
}
