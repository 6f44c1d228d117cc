"""Realistic mistakes in module 04 (grade_id -> what a student might write), and right answers written
differently from the reference. Every WRONG/MORE_WRONG answer must lose all the points of its exercise's
test cells, except those of the cells it names (`(code, [cells])`: cells whose pitfall it gets right);
RIGHT must get full marks.

The test cells, one per pitfall: test_training_state_files (who writes which file), _rng (every rank gets its own
stream back), _cpu (a GPU-written checkpoint loads on a CPU-only machine), _restart (4 ranks restarted from cloud
storage end on the uninterrupted run); test_resume_epoch (where the group starts), _state (every rank holds the
checkpoint's state), _storage (a checkpoint in cloud storage); test_make_run_config_failures, _keep (most recent or
best, how many), _score (the order as given); test_build_tuner_search, _asha."""

_GIVEN = (  # the lines of the training_state cell that are given to the student
    "STATE_FILE = 'state.pt'\n"
    "def rng_file(rank):\n"
    "    return f'rng_rank_{rank}.pt'\n"
)

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
          rng_load="torch.load(os.path.join(directory, rng_file(rank)), map_location='cpu', weights_only=True)",
          model="getattr(model, 'module', model)"):
    return ("def load_training_state(directory, model, optimizer):\n"
            f"    rank = {rank}\n"
            f"    {state_line}\n"
            f"    {model}.load_state_dict(state['model'])\n"
            + ("    optimizer.load_state_dict(state['optimizer'])\n" if optimizer else "")
            + (f"    torch.set_rng_state({rng_load})\n" if rng else "")
            + "    return state['epoch']\n")


def _resume(body):
    return ("def resume(model, optimizer):\n"
            "    checkpoint = ray.train.get_checkpoint()\n"
            "    if checkpoint is None:\n"
            "        return 0\n" + body)


def _tuner(space="{'lr': tune.loguniform(lr_range[0], lr_range[1]), 'global_batch_size': tune.choice(batch_sizes)}",
           tune_config="metric='accuracy', mode='max', num_samples=num_samples, max_concurrent_trials=2",
           scheduler="ASHAScheduler(max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)",
           run_config="tune.RunConfig(name=name, storage_path=storage_path)", imports=""):
    return (imports + "def build_tuner(trial, num_samples, max_epochs, min_epochs, lr_range, batch_sizes, "
            "storage_path, name):\n"
            f"    return tune.Tuner(trial, param_space={space},\n"
            f"        tune_config=tune.TuneConfig({tune_config}, scheduler={scheduler}),\n"
            f"        run_config={run_config})\n")


def _run_config(failures="-1 if max_retries is None else max_retries",
                checkpoint="num_to_keep=keep, checkpoint_score_attribute=metric, checkpoint_score_order=mode",
                cls="RunConfig"):
    return ("def make_run_config(name, storage_path, max_retries, keep, metric, mode):\n"
            f"    return {cls}(name=name, storage_path=storage_path,\n"
            f"        failure_config=FailureConfig(max_failures={failures}),\n"
            f"        checkpoint_config=CheckpointConfig({checkpoint}))\n")


WRONG = {
    # the single-file checkpoint of a one-process loop: rank 0 saves ITS RNG state with the model, and every
    # rank of the restarted group restores rank 0's stream (all ranks then draw the same noise). Who writes what is
    # allowed (ranks 1-3 write nothing), and a GPU-written copy loads on the CPU.
    "training_state": (_GIVEN + (
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
        "    return state['epoch']\n"), ["test_training_state_files", "test_training_state_cpu"]),
    # resumes AT the saved epoch: the epoch that had finished is trained twice (the state it restores is right,
    # from cloud storage too)
    "resume": (_resume(
        "    with checkpoint.as_directory() as d:\n"
        "        return load_training_state(d, model, optimizer)\n"), ["test_resume_state", "test_resume_storage"]),
    # mode forgotten: checkpoint_score_order left at its default, "max" (keeps the highest losses)
    "make_run_config": (_run_config(checkpoint="num_to_keep=keep, checkpoint_score_attribute=metric"),
                        ["test_make_run_config_failures", "test_make_run_config_keep"]),
    # metric/mode swapped: ranks trials by accuracy, lowest first (the scheduler is right)
    "build_tuner": (_tuner(tune_config="metric='accuracy', mode='min', num_samples=num_samples, "
                                       "max_concurrent_trials=2"), ["test_build_tuner_asha"]),
}

MORE_WRONG = [
    {   # the RNG file named after the LOCAL rank: on 2 nodes, ranks 0 and 2 (and 1 and 3) write the same file
        # (a GPU-written checkpoint still loads on the CPU)
        "training_state": (_GIVEN + (
            "def save_training_state(directory, model, optimizer, epoch):\n"
            "    ctx = ray.train.get_context()\n"
            "    if ctx.get_world_rank() == 0:\n"
            "        torch.save({'model': getattr(model, 'module', model).state_dict(),\n"
            "                    'optimizer': optimizer.state_dict(), 'epoch': epoch}, os.path.join(directory, STATE_FILE))\n"
            "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(ctx.get_local_rank())))\n")
            + _load(rank="ray.train.get_context().get_local_rank()"), ["test_training_state_cpu"]),
        # "no limit" written as 0
        "make_run_config": (_run_config(failures="0 if max_retries is None else max_retries"),
                            ["test_make_run_config_keep", "test_make_run_config_score"]),
        # ASHA without a grace period: a trial can be stopped after its first epoch
        "build_tuner": (_tuner(scheduler="ASHAScheduler(max_t=max_epochs, reduction_factor=2)"),
                        ["test_build_tuner_search"]),
        # only the weights are restored (the epoch is read back): optimizer and RNG start again
        "resume": (_resume(
            "    with checkpoint.as_directory() as d:\n"
            "        state = torch.load(os.path.join(d, STATE_FILE), map_location='cpu', weights_only=True)\n"
            "    getattr(model, 'module', model).load_state_dict(state['model'])\n"
            "    return state['epoch'] + 1\n"), ["test_resume_epoch", "test_resume_storage"]),
    },
    {   # no map_location: the tensors go back to the GPU that wrote them (fails where there is none; a checkpoint
        # written on CPUs restarts fine)
        "training_state": (_GIVEN + _SAVE_OK + _load(
            state_line="state = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)",
            rng_load="torch.load(os.path.join(directory, rng_file(rank)), weights_only=True)"),
            ["test_training_state_files", "test_training_state_rng", "test_training_state_restart"]),
        # keeps the most recent checkpoints: no score attribute (and so no order)
        "make_run_config": (_run_config(checkpoint="num_to_keep=keep"), ["test_make_run_config_failures"]),
        # a uniform learning rate: 90% of the draws land in the top decade
        "build_tuner": (_tuner(space="{'lr': tune.uniform(*lr_range), 'global_batch_size': tune.choice(batch_sizes)}"),
                        ["test_build_tuner_asha"]),
        # the checkpoint's files read at checkpoint.path: right for a local folder, but in cloud storage the path
        # is inside a bucket ('bucket/path'), not on this machine
        "resume": (_resume("    return load_training_state(checkpoint.path, model, optimizer) + 1\n"),
                   ["test_resume_epoch", "test_resume_state"]),
    },
    {   # the optimizer state is neither saved nor restored: Adam's moments start again from zero (each rank's
        # stream comes back, and the file loads on the CPU)
        "training_state": (_GIVEN + (
            "def save_training_state(directory, model, optimizer, epoch):\n"
            "    rank = ray.train.get_context().get_world_rank()\n"
            "    if rank == 0:\n"
            "        torch.save({'model': getattr(model, 'module', model).state_dict(), 'epoch': epoch},\n"
            "                   os.path.join(directory, STATE_FILE))\n"
            "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(rank)))\n")
            + _load(optimizer=False), ["test_training_state_rng", "test_training_state_cpu"]),
        # Tune's RunConfig, where the TorchTrainer needs ray.train's (TorchTrainer refuses it); the checkpoints are right
        "make_run_config": (_run_config(cls="tune.RunConfig"),
                            ["test_make_run_config_keep", "test_make_run_config_score"]),
        # metric and mode both in ASHA and in the TuneConfig: Tune refuses the run at fit() (the rungs are right)
        "build_tuner": (_tuner(scheduler="ASHAScheduler(metric='accuracy', mode='max', max_t=max_epochs, "
                                         "grace_period=min_epochs, reduction_factor=2)"), ["test_build_tuner_asha"]),
        # the downloaded copy used after the with block: as_directory() deletes it on exit when the checkpoint is
        # in cloud storage (a local checkpoint's folder is the checkpoint itself, and stays)
        "resume": (_resume(
            "    with checkpoint.as_directory() as d:\n"
            "        folder = d\n"
            "    return load_training_state(folder, model, optimizer) + 1\n"), ["test_resume_epoch", "test_resume_state"]),
    },
    {   # the model's state_dict saved wrapped ('module.' prefixes) and loaded into the wrapped model: a restart
        # under DDP works, but the checkpoint does not load into a plain model
        "training_state": (_GIVEN + (
            "def save_training_state(directory, model, optimizer, epoch):\n"
            "    rank = ray.train.get_context().get_world_rank()\n"
            "    if rank == 0:\n"
            "        torch.save({'model': model.state_dict(), 'optimizer': optimizer.state_dict(), 'epoch': epoch},\n"
            "                   os.path.join(directory, STATE_FILE))\n"
            "    torch.save(torch.get_rng_state(), os.path.join(directory, rng_file(rank)))\n")
            + _load(model="model"), ["test_training_state_restart"]),
        # the score order guessed from the metric's name instead of the mode given
        "make_run_config": (_run_config(checkpoint="num_to_keep=keep, checkpoint_score_attribute=metric, "
                                                   "checkpoint_score_order='min' if 'loss' in (metric or '') else 'max'"),
                            ["test_make_run_config_failures", "test_make_run_config_keep"]),
        # a BasicVariantGenerator as the search and the limit in the TuneConfig: beside a search generator Tune
        # ignores max_concurrent_trials, and every trial runs at once
        "build_tuner": (_tuner(tune_config="metric='accuracy', mode='max', num_samples=num_samples, "
                                           "max_concurrent_trials=2, search_alg=BasicVariantGenerator()",
                               imports="from ray.tune.search import BasicVariantGenerator\n"),
                        ["test_build_tuner_asha"]),
    },
    {   # "up to max_retries, or forever": 0 (never retry) read as no limit
        "make_run_config": (_run_config(failures="max_retries or -1"),
                            ["test_make_run_config_keep", "test_make_run_config_score"]),
        # an older tutorial's load, weights_only=False: unpickling runs any call a tampered or foreign file holds
        # (the files, streams and restart are right)
        "training_state": (_GIVEN + _SAVE_OK + _load(
            state_line="state = torch.load(os.path.join(directory, STATE_FILE), map_location='cpu', weights_only=False)",
            rng_load="torch.load(os.path.join(directory, rng_file(rank)), map_location='cpu', weights_only=False)"),
            ["test_training_state_files", "test_training_state_rng", "test_training_state_restart"]),
    },
    {   # "the most recent" read as the best by epoch, with the mode given: mode='min' keeps the oldest
        "make_run_config": (_run_config(checkpoint="num_to_keep=keep, checkpoint_score_attribute=metric or 'epoch', "
                                                   "checkpoint_score_order=mode"),
                            ["test_make_run_config_failures", "test_make_run_config_score"]),
        # the storage path "cleaned up" through pathlib: right for a folder, but a URI ('mock://bucket/tune', as
        # 's3://...') becomes a local folder 'mock:/bucket/tune' (the scheduler is right)
        "build_tuner": (_tuner(run_config="tune.RunConfig(name=name, storage_path=str(Path(storage_path).resolve()))"),
                        ["test_build_tuner_asha"]),
    },
    {   # the storage path made absolute with os.path: right for a folder, but 's3://bucket/runs' becomes the local
        # folder '<cwd>/s3:/bucket/runs' (the failures and the checkpoints kept are right)
        "make_run_config": (_run_config().replace("storage_path=storage_path",
                                                  "storage_path=os.path.abspath(storage_path)"),
                            ["test_make_run_config_keep", "test_make_run_config_score"]),
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
    # to_directory(): a local copy of the checkpoint (downloaded from cloud storage), which stays
    "resume": (
        "def resume(model, optimizer):\n"
        "    if (ckpt := ray.train.get_checkpoint()) is None:\n"
        "        return 0\n"
        "    last_finished = load_training_state(ckpt.to_directory(), model, optimizer)\n"
        "    return last_finished + 1\n"),
    # no score attribute at all without a metric; the mode checked against the two values Ray knows
    "make_run_config": (
        "def make_run_config(name, storage_path, max_retries, keep, metric, mode):\n"
        "    failures = FailureConfig(max_failures=int(max_retries) if max_retries is not None else -1)\n"
        "    if metric is None:\n"
        "        keeping = CheckpointConfig(num_to_keep=keep)\n"
        "    else:\n"
        "        keeping = CheckpointConfig(num_to_keep=keep, checkpoint_score_attribute=metric,\n"
        "                                   checkpoint_score_order={'min': 'min', 'max': 'max'}[mode])\n"
        "    return ray.train.RunConfig(storage_path=storage_path, name=name, failure_config=failures,\n"
        "                               checkpoint_config=keeping)\n"),
    # metric and mode given to the scheduler (AsyncHyperBandScheduler itself) rather than the TuneConfig; the
    # concurrency limited by the search (BasicVariantGenerator(max_concurrent=2)) rather than the TuneConfig; the
    # notebook's RunConfig, ray.train's (Tuner accepts it, with a deprecation warning on stderr)
    "build_tuner": (
        "from ray.tune.schedulers import AsyncHyperBandScheduler\n"
        "from ray.tune.search.basic_variant import BasicVariantGenerator\n"
        "\n"
        "def build_tuner(trial, num_samples, max_epochs, min_epochs, lr_range, batch_sizes, storage_path, name):\n"
        "    space = dict(lr=tune.loguniform(min(lr_range), max(lr_range)),\n"
        "                 global_batch_size=tune.choice([b for b in batch_sizes]))\n"
        "    asha = AsyncHyperBandScheduler(metric='accuracy', mode='max', time_attr='training_iteration',\n"
        "                                   max_t=max_epochs, grace_period=min_epochs, reduction_factor=2)\n"
        "    config = tune.TuneConfig(num_samples=num_samples, scheduler=asha,\n"
        "                             search_alg=BasicVariantGenerator(max_concurrent=2))\n"
        "    return tune.Tuner(trial, param_space=space, tune_config=config,\n"
        "                      run_config=RunConfig(storage_path=storage_path, name=name))\n"),
}
