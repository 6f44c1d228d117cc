"""Realistic mistakes in module 04 (grade_id -> what a student might write), and right answers written
differently from the reference. Every WRONG/MORE_WRONG answer must lose all the points of its exercise's
test cells; RIGHT must get full marks."""

_GIVEN = (  # the lines of the training_state cell that are given to the student
    "STATE_FILE = 'state.pt'\n"
    "def rng_file(rank):\n"
    "    return f'rng_rank_{rank}.pt'\n"
)

WRONG = {
    # the single-file checkpoint of a one-process loop: rank 0 saves ITS RNG state with the model, and every
    # rank of the restarted group restores rank 0's stream (all ranks then draw the same noise)
    "training_state": _GIVEN + (
        "def save_training_state(directory, model, optimizer, epoch):\n"
        "    if ray.train.get_context().get_world_rank() == 0:\n"
        "        torch.save({'model': getattr(model, 'module', model).state_dict(),\n"
        "                    'optimizer': optimizer.state_dict(), 'epoch': epoch,\n"
        "                    'rng': torch.get_rng_state()}, os.path.join(directory, STATE_FILE))\n"
        "def load_training_state(directory, model, optimizer):\n"
        "    state = torch.load(os.path.join(directory, STATE_FILE), map_location='cpu', weights_only=True)\n"
        "    getattr(model, 'module', model).load_state_dict(state['model'])\n"
        "    optimizer.load_state_dict(state['optimizer'])\n"
        "    torch.set_rng_state(state['rng'])\n"
        "    return state['epoch']\n"),
    # resumes AT the saved epoch: the epoch that had finished is trained twice
    "resume": (
        "def resume(model, optimizer):\n"
        "    checkpoint = ray.train.get_checkpoint()\n"
        "    if checkpoint is None:\n"
        "        return 0\n"
        "    with checkpoint.as_directory() as d:\n"
        "        return load_training_state(d, model, optimizer)\n"),
    # keeps the highest losses: checkpoint_score_order left at its default, "max"
    "make_run_config": (
        "def make_run_config(name, storage_path, max_retries, keep, metric):\n"
        "    retries = -1 if max_retries is None else max_retries\n"
        "    return RunConfig(name=name, storage_path=storage_path,\n"
        "                     failure_config=FailureConfig(max_failures=retries),\n"
        "                     checkpoint_config=CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=metric))\n"),
    # metric/mode swapped: ranks trials by accuracy, lowest first
    "build_tuner": (
        "def build_tuner(trial, num_samples, max_epochs, min_epochs, lr_range, batch_sizes, storage_path, name):\n"
        "    return tune.Tuner(trial,\n"
        "        param_space={'lr': tune.loguniform(*lr_range), 'global_batch_size': tune.choice(batch_sizes)},\n"
        "        tune_config=tune.TuneConfig(metric='accuracy', mode='min', num_samples=num_samples,\n"
        "            max_concurrent_trials=2,\n"
        "            scheduler=ASHAScheduler(max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)),\n"
        "        run_config=tune.RunConfig(name=name, storage_path=storage_path))\n"),
}

_SAVE_OK = (
    "def save_training_state(directory, model, optimizer, epoch):\n"
    "    rank = ray.train.get_context().get_world_rank()\n"
    "    if rank == 0:\n"
    "        torch.save({'model': getattr(model, 'module', model).state_dict(),\n"
    "                    'optimizer': optimizer.state_dict(), 'epoch': epoch}, os.path.join(directory, STATE_FILE))\n"
    "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(rank)))\n"
)


def _load(state_line="state = torch.load(os.path.join(directory, STATE_FILE), map_location='cpu', weights_only=True)",
          optimizer=True, rng=True, rank="ray.train.get_context().get_world_rank()",
          rng_load="torch.load(os.path.join(directory, rng_file(rank)), map_location='cpu', weights_only=True)"):
    return ("def load_training_state(directory, model, optimizer):\n"
            f"    rank = {rank}\n"
            f"    {state_line}\n"
            "    getattr(model, 'module', model).load_state_dict(state['model'])\n"
            + ("    optimizer.load_state_dict(state['optimizer'])\n" if optimizer else "")
            + (f"    torch.set_rng_state({rng_load})\n" if rng else "")
            + "    return state['epoch']\n")


def _tuner(space="{'lr': tune.loguniform(lr_range[0], lr_range[1]), 'global_batch_size': tune.choice(batch_sizes)}",
           tune_config="metric='accuracy', mode='max', num_samples=num_samples, max_concurrent_trials=2",
           scheduler="ASHAScheduler(max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)",
           run_config="tune.RunConfig(name=name, storage_path=storage_path)"):
    return ("def build_tuner(trial, num_samples, max_epochs, min_epochs, lr_range, batch_sizes, storage_path, name):\n"
            f"    return tune.Tuner(trial, param_space={space},\n"
            f"        tune_config=tune.TuneConfig({tune_config}, scheduler={scheduler}),\n"
            f"        run_config={run_config})\n")


def _run_config(failures="-1 if max_retries is None else max_retries",
                checkpoint="num_to_keep=keep, checkpoint_score_attribute=metric, "
                           "checkpoint_score_order='min' if metric.endswith('loss') else 'max'",
                cls="RunConfig"):
    return ("def make_run_config(name, storage_path, max_retries, keep, metric):\n"
            f"    return {cls}(name=name, storage_path=storage_path,\n"
            f"        failure_config=FailureConfig(max_failures={failures}),\n"
            f"        checkpoint_config=CheckpointConfig({checkpoint}))\n")


MORE_WRONG = [
    {   # the RNG file named after the LOCAL rank: on 2 nodes, ranks 0 and 2 (and 1 and 3) write the same file
        "training_state": _GIVEN + (
            "def save_training_state(directory, model, optimizer, epoch):\n"
            "    ctx = ray.train.get_context()\n"
            "    if ctx.get_world_rank() == 0:\n"
            "        torch.save({'model': getattr(model, 'module', model).state_dict(),\n"
            "                    'optimizer': optimizer.state_dict(), 'epoch': epoch}, os.path.join(directory, STATE_FILE))\n"
            "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(ctx.get_local_rank())))\n")
        + _load(rank="ray.train.get_context().get_local_rank()"),
        # "no limit" written as 0
        "make_run_config": _run_config(failures="0 if max_retries is None else max_retries"),
        # ASHA without a grace period: a trial can be stopped after its first epoch
        "build_tuner": _tuner(scheduler="ASHAScheduler(max_t=max_epochs, reduction_factor=2)"),
        # only the weights are restored (the epoch is read back): optimizer and RNG start again
        "resume": (
            "def resume(model, optimizer):\n"
            "    checkpoint = ray.train.get_checkpoint()\n"
            "    if checkpoint is None:\n"
            "        return 0\n"
            "    with checkpoint.as_directory() as d:\n"
            "        state = torch.load(os.path.join(d, STATE_FILE), map_location='cpu', weights_only=True)\n"
            "    getattr(model, 'module', model).load_state_dict(state['model'])\n"
            "    return state['epoch'] + 1\n"),
    },
    {   # no map_location: the tensors go back to the GPU that wrote them (fails where there is none)
        "training_state": _GIVEN + _SAVE_OK + _load(
            state_line="state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)",
            rng_load="torch.load(os.path.join(directory, rng_file(rank)), weights_only=True)"),
        # keeps the most recent checkpoints: no score attribute
        "make_run_config": _run_config(checkpoint="num_to_keep=keep"),
        # a uniform learning rate: 90% of the draws land in the top decade
        "build_tuner": _tuner(space="{'lr': tune.uniform(*lr_range), 'global_batch_size': tune.choice(batch_sizes)}"),
    },
    {   # the optimizer state is neither saved nor restored: Adam's moments start again from zero
        "training_state": _GIVEN + (
            "def save_training_state(directory, model, optimizer, epoch):\n"
            "    rank = ray.train.get_context().get_world_rank()\n"
            "    if rank == 0:\n"
            "        torch.save({'model': getattr(model, 'module', model).state_dict(), 'epoch': epoch},\n"
            "                   os.path.join(directory, STATE_FILE))\n"
            "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(rank)))\n")
        + _load(optimizer=False),
        # Tune's RunConfig, where the TorchTrainer needs ray.train's (its run refuses it)
        "make_run_config": _run_config(cls="tune.RunConfig"),
        # metric and mode both in ASHA and in the TuneConfig: Tune refuses the run at fit()
        "build_tuner": _tuner(scheduler="ASHAScheduler(metric='accuracy', mode='max', max_t=max_epochs, "
                                        "grace_period=min_epochs, reduction_factor=2)"),
    },
]

RIGHT = {
    # every rank's RNG state gathered to rank 0 (one collective), saved in rank 0's file; map_location is the
    # worker's device; the unwrapped model found with isinstance
    "training_state": _GIVEN + (
        "from torch.nn.parallel import DistributedDataParallel\n"
        "\n"
        "def _plain(model):\n"
        "    return model.module if isinstance(model, DistributedDataParallel) else model\n"
        "\n"
        "def save_training_state(directory, model, optimizer, epoch):\n"
        "    ctx = ray.train.get_context()\n"
        "    rngs = [None] * ctx.get_world_size()\n"
        "    if dist.is_initialized():\n"
        "        dist.all_gather_object(rngs, torch.get_rng_state())\n"
        "    else:\n"
        "        rngs = [torch.get_rng_state()]\n"
        "    if ctx.get_world_rank() == 0:\n"
        "        torch.save(dict(model=_plain(model).state_dict(), optimizer=optimizer.state_dict(),\n"
        "                        epoch=epoch, rngs=rngs), Path(directory) / STATE_FILE)\n"
        "\n"
        "def load_training_state(directory, model, optimizer):\n"
        "    saved = torch.load(Path(directory) / STATE_FILE, map_location=ray.train.torch.get_device())\n"
        "    _plain(model).load_state_dict(saved['model'])\n"
        "    optimizer.load_state_dict(saved['optimizer'])\n"
        "    torch.set_rng_state(saved['rngs'][ray.train.get_context().get_world_rank()].cpu())\n"
        "    return int(saved['epoch'])\n"),
    "resume": (
        "def resume(model, optimizer):\n"
        "    if (ckpt := ray.train.get_checkpoint()) is None:\n"
        "        return 0\n"
        "    with ckpt.as_directory() as folder:\n"
        "        last_finished = load_training_state(folder, model, optimizer)\n"
        "        return last_finished + 1\n"),
    "make_run_config": (
        "def make_run_config(name, storage_path, max_retries, keep, metric):\n"
        "    lower_is_better = metric.endswith('loss')\n"
        "    failures = FailureConfig(max_failures=max_retries if max_retries is not None else -1)\n"
        "    keeping = CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=metric,\n"
        "                               checkpoint_score_order='min' if lower_is_better else 'max')\n"
        "    return ray.train.RunConfig(storage_path=storage_path, name=name, failure_config=failures,\n"
        "                               checkpoint_config=keeping)\n"),
    # metric and mode given to the scheduler (AsyncHyperBandScheduler itself) rather than the TuneConfig
    "build_tuner": (
        "from ray.tune.schedulers import AsyncHyperBandScheduler\n"
        "\n"
        "def build_tuner(trial, num_samples, max_epochs, min_epochs, lr_range, batch_sizes, storage_path, name):\n"
        "    space = dict(lr=tune.loguniform(min(lr_range), max(lr_range)),\n"
        "                 global_batch_size=tune.choice([b for b in batch_sizes]))\n"
        "    asha = AsyncHyperBandScheduler(metric='accuracy', mode='max', time_attr='training_iteration',\n"
        "                                   max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)\n"
        "    config = tune.TuneConfig(num_samples=num_samples, scheduler=asha, max_concurrent_trials=2)\n"
        "    return tune.Tuner(trial, param_space=space, tune_config=config,\n"
        "                      run_config=tune.RunConfig(storage_path=storage_path, name=name, verbose=0))\n"),
}
