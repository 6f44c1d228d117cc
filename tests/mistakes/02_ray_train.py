"""Realistic mistakes in module 02 (grade_id -> what a student might write), and right answers written
differently from the reference.

Each wrong train_func below is a student's own working answer (``_TRAIN``) with one realistic mistake.
"""

_TRAIN = '''
def train_func(config: dict) -> None:
    torch.manual_seed(config["seed"])
    model = ray.train.torch.prepare_model(build_model(config["model"]))
    if config["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
    criterion = torch.nn.CrossEntropyLoss()
    world_size = ray.train.get_context().get_world_size()
    if config["global_batch_size"] % world_size != 0:
        raise ValueError("the global batch size must be divisible by the number of workers")
    batch_size = config["global_batch_size"] // world_size
    dataset = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    for epoch in range(config["epochs"]):
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        model.train()
        loss_sum, count = 0.0, 0
        for images, labels in loader:
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss_sum += loss.item() * len(labels)
            count += len(labels)
        stats = torch.tensor([loss_sum, count], dtype=torch.float64)
        dist.all_reduce(stats)
        metrics = {"epoch": epoch, "loss": (stats[0] / stats[1]).item()}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if ray.train.get_context().get_world_rank() == 0:
                torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)
'''


def _train(old: str, new: str) -> str:
    """_TRAIN with one mistake: ``old`` replaced by ``new`` (``old`` must be there)."""
    assert old in _TRAIN, old
    return _TRAIN.replace(old, new)


_SPLIT_CHECK = '''    if config["global_batch_size"] % world_size != 0:
        raise ValueError("the global batch size must be divisible by the number of workers")
'''

WRONG = {
    # forgets set_epoch: every epoch visits the data in epoch 0's order
    "train_func": _train('''        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
''', ""),
    # ignores the choice's CPUs per worker (Ray reserves 1 CPU each: 3 x 0.5 CPU workers would wait for 3 CPUs)
    "scaling_config_for": (
        "def scaling_config_for(choice: dict) -> ScalingConfig:\n"
        "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'])\n"),
    # a RunConfig without the CheckpointConfig: every checkpoint kept, none scored
    "build_trainer": (
        "def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
        "                  score_attribute, score_order):\n"
        "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
        "                        run_config=RunConfig(storage_path=storage_path, name=name))\n"),
    # concept questions: one of the two things prepare_data_loader leaves to you; one row per checkpoint
    "concept_data_loader": 'CONCEPT_DATA_LOADER = "c"\n',
    "concept_metrics_rows": 'CONCEPT_METRICS_ROWS = "c"\n',
}

MORE_WRONG = [
    {   # the global batch as each worker's batch (4 workers: 4 x 32 examples per step), no split check
        "train_func": _train(_SPLIT_CHECK + '''    batch_size = config["global_batch_size"] // world_size
''', '''    batch_size = config["global_batch_size"]
'''),
        # use_gpu forgotten: GPU choices train on CPU
        "scaling_config_for": (
            "def scaling_config_for(choice):\n"
            "    return ScalingConfig(num_workers=choice['num_workers'],\n"
            "                         resources_per_worker={'CPU': choice['cpus_per_worker']})\n"),
        # the score order hard-coded to "min" (an accuracy would keep the worst checkpoints)
        "build_trainer": (
            "def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
            "                  score_attribute, score_order):\n"
            "    keep = CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute=score_attribute,\n"
            "                            checkpoint_score_order='min')\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=RunConfig(storage_path=storage_path, name=name, checkpoint_config=keep))\n"),
    },
    {   # a checkpoint from every rank
        "train_func": _train('''            if ray.train.get_context().get_world_rank() == 0:
                torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
''', '''            torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
            checkpoint = Checkpoint.from_directory(tmp)
'''),
        # a GPU in every worker's resources, even on a CPU choice
        "scaling_config_for": (
            "def scaling_config_for(choice):\n"
            "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker={'CPU': choice['cpus_per_worker'], 'GPU': 1})\n"),
        # train_loop_config never reaches the workers
        "build_trainer": (
            "def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
            "                  score_attribute, score_order):\n"
            "    keep = CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute=score_attribute,\n"
            "                            checkpoint_score_order=score_order)\n"
            "    return TorchTrainer(train_func, scaling_config=scaling_config,\n"
            "                        run_config=RunConfig(storage_path=storage_path, name=name, checkpoint_config=keep))\n"),
    },
    {   # a checkpoint from local rank 0: one per node (ranks 0 and 2 on 2 nodes x 2 workers)
        "train_func": _train("if ray.train.get_context().get_world_rank() == 0:",
                             "if ray.train.get_context().get_local_rank() == 0:"),
        # 1 CPU per worker whatever the choice
        "scaling_config_for": (
            "def scaling_config_for(choice):\n"
            "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker={'CPU': 1})\n"),
        # the scaling config forgotten: TorchTrainer's default (1 worker)
        "build_trainer": (
            "def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
            "                  score_attribute, score_order):\n"
            "    keep = CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute=score_attribute,\n"
            "                            checkpoint_score_order=score_order)\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config,\n"
            "                        run_config=RunConfig(storage_path=storage_path, name=name, checkpoint_config=keep))\n"),
    },
    {   # the loss not averaged over workers: each rank reports its own (rank 0's is what Ray Train keeps)
        "train_func": _train("        dist.all_reduce(stats)\n", ""),
    },
    {   # the wrapped model saved: keys start with 'module.' and do not load into a plain model
        "train_func": _train('getattr(model, "module", model).state_dict()', "model.state_dict()"),
    },
    {   # floor division: 32 over 3 workers silently becomes 3 x 10 (the global batch changed, no error)
        "train_func": _train(_SPLIT_CHECK, ""),
    },
    {   # the split by the workers on this node, not in the whole run
        "train_func": _train("world_size = ray.train.get_context().get_world_size()",
                             "world_size = ray.train.get_context().get_local_world_size()"),
    },
]

RIGHT = {
    "scaling_config_for": '''
def scaling_config_for(choice: dict) -> ScalingConfig:
    resources = {"CPU": float(choice["cpus_per_worker"])}
    if choice["use_gpu"]:
        resources["GPU"] = 1
    return ScalingConfig(num_workers=int(choice["num_workers"]), use_gpu=bool(choice["use_gpu"]),
                         resources_per_worker=resources)
''',
    # data first, world size from torch.distributed, isinstance checks, a device tensor of per-rank means
    # averaged with all_reduce / world size, report in two branches, float()
    "train_func": '''
from torch.nn.parallel import DistributedDataParallel


def train_func(config: dict) -> None:
    n = dist.get_world_size() if dist.is_initialized() else 1
    per_worker, rest = divmod(config["global_batch_size"], n)
    if rest:
        raise ValueError(f"{config['global_batch_size']} examples per step cannot be split over {n} workers")
    data = load_digits(train=True, limit=config["train_samples"], quiet=True)
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(data.dataset(), batch_size=per_worker, shuffle=True, drop_last=True))
    torch.manual_seed(config["seed"])
    net = ray.train.torch.prepare_model(build_model(config["model"]))
    opt_cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[config["optimizer"]]
    opt = opt_cls(net.parameters(), lr=config["lr"])
    loss_fn = torch.nn.CrossEntropyLoss()
    device = ray.train.torch.get_device()
    for epoch in range(config["epochs"]):
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(epoch)
        net.train()
        batch_losses = []
        for x, y in loader:
            opt.zero_grad()
            out = loss_fn(net(x), y)
            out.backward()
            opt.step()
            batch_losses.append(out.detach())
        mean = torch.stack(batch_losses).mean().to(device)   # equal batches: the mean of batch means
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        report = {"loss": float(mean), "epoch": epoch}
        if ray.train.get_context().get_world_rank() != 0:
            ray.train.report(report)
            continue
        folder = tempfile.mkdtemp()
        inner = net.module if isinstance(net, DistributedDataParallel) else net
        torch.save(inner.state_dict(), f"{folder}/model.pt")
        ray.train.report(report, checkpoint=Checkpoint.from_directory(folder))
''',
    "build_trainer": '''
def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,
                  score_attribute, score_order):
    config = RunConfig(name=name, storage_path=str(storage_path),
                       checkpoint_config=CheckpointConfig(num_to_keep, score_attribute, score_order))
    return TorchTrainer(train_loop_per_worker=train_func, run_config=config, scaling_config=scaling_config,
                        train_loop_config=train_loop_config)
''',
    "concept_prepare_model": 'CONCEPT_PREPARE_MODEL = "B"  # no wrapper with one worker\n',
    "concept_data_loader": 'CONCEPT_DATA_LOADER = ["d", "c"]\n',
    "concept_report": "CONCEPT_REPORT = ' b '\n",
}
