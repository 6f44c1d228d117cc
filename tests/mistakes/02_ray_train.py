"""Realistic mistakes in module 02 (grade_id -> what a student might write), and right answers written
differently from the reference.

Each wrong train_func below is a student's own working answer (``_TRAIN``) with one realistic mistake, and
each wrong load_model is ``_LOAD`` with one. The test cells of an exercise check one pitfall each
(``test_train_func_same_weights``, ``_reports``, ``_uneven_batch``, ``_one_worker``, ``_device``;
``test_scaling_config_for_cpus``, ``_gpus``; ``test_build_trainer_checkpoints``, ``_run``;
``test_load_model_storage``, ``_for_inference``): a mistake names the cells whose pitfall it gets right.
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
        stats = torch.tensor([loss_sum, count], dtype=torch.float64, device=ray.train.torch.get_device())
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

_LOAD = """
def load_model(checkpoint: Checkpoint, model_name: str = "resnet18") -> torch.nn.Module:
    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, "model.pt"), map_location="cpu", weights_only=True)
    model = build_model(model_name)
    model.load_state_dict(state)
    model.eval()
    return model
"""


def _load(old: str, new: str) -> str:
    """_LOAD with one mistake."""
    assert old in _LOAD, old
    return _LOAD.replace(old, new)


def _trainer(keep: str = "CheckpointConfig(num_to_keep=num_to_keep, checkpoint_score_attribute=score_attribute,\n"
                         "                            checkpoint_score_order=score_order)",
             storage: str = "storage_path", scaling: str = "scaling_config=scaling_config, ",
             loop: str = "train_loop_config=train_loop_config, ") -> str:
    """A build_trainer whose CheckpointConfig, storage path, scaling or loop config is written as given."""
    return ("def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
            "                  score_attribute, score_order):\n"
            f"    keep = {keep}\n"
            f"    return TorchTrainer(train_func, {(loop + scaling).rstrip()}\n"
            f"                        run_config=RunConfig(storage_path={storage}, name=name, checkpoint_config=keep))\n")


def _scaling(body: str) -> str:
    return f"def scaling_config_for(choice: dict) -> ScalingConfig:\n{body}"


_TRAIN_CELLS = ("test_train_func_same_weights", "test_train_func_reports", "test_train_func_uneven_batch",
                "test_train_func_one_worker", "test_train_func_device")


def _keeps(*failed: str) -> list[str]:
    """The train_func cells other than those a mistake fails (given without their prefix)."""
    lost = {f"test_train_func_{f}" for f in failed}
    assert lost <= set(_TRAIN_CELLS), lost
    return [c for c in _TRAIN_CELLS if c not in lost]


WRONG = {
    # forgets set_epoch: every epoch visits the data in epoch 0's order (epoch 0 itself is right)
    "train_func": (_train('''        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
''', ""), _keeps("same_weights")),
    # ignores the choice's CPUs per worker (Ray reserves 1 CPU each: 3 x 0.5 CPU workers would wait for 3 CPUs)
    "scaling_config_for": (_scaling(
        "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'])\n"),
        ["test_scaling_config_for_gpus"]),
    # a RunConfig without the CheckpointConfig: every checkpoint kept, none scored
    "build_trainer": (
        "def build_trainer(train_func, scaling_config, storage_path, name, train_loop_config, num_to_keep,\n"
        "                  score_attribute, score_order):\n"
        "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
        "                        run_config=RunConfig(storage_path=storage_path, name=name))\n",
        ["test_build_trainer_run"]),
    # reads model.pt at checkpoint.path: a path on the checkpoint's filesystem, not on this machine
    "load_model": (_load('''    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, "model.pt"), map_location="cpu", weights_only=True)
''', '''    state = torch.load(os.path.join(checkpoint.path, "model.pt"), map_location="cpu", weights_only=True)
'''), ["test_load_model_for_inference"]),
    # concept questions: one of the two things prepare_data_loader leaves to you; the latest checkpoint given a row
    # (the key this notebook had before Result.metrics_dataframe was read in Ray 2.60); the storage check thought to
    # happen at every report, or at none
    "concept_data_loader": 'CONCEPT_DATA_LOADER = "c"\n',
    "concept_metrics_rows": 'CONCEPT_METRICS_ROWS = "d"\n',
    "concept_shared_storage": 'CONCEPT_SHARED_STORAGE = "c"\n',
}

MORE_WRONG = [
    {   # the global batch as each worker's batch (4 workers: 4 x 32 examples per step), no split check
        "train_func": (_train(_SPLIT_CHECK + '''    batch_size = config["global_batch_size"] // world_size
''', '''    batch_size = config["global_batch_size"]
'''), _keeps("same_weights", "reports", "uneven_batch")),
        # use_gpu forgotten: GPU choices train on CPU
        "scaling_config_for": (_scaling(
            "    return ScalingConfig(num_workers=choice['num_workers'],\n"
            "                         resources_per_worker={'CPU': choice['cpus_per_worker']})\n"),
            ["test_scaling_config_for_cpus"]),
        # the score order hard-coded to "min" (an accuracy would keep the worst checkpoints)
        "build_trainer": (_trainer(keep="CheckpointConfig(num_to_keep=num_to_keep, "
                                        "checkpoint_score_attribute=score_attribute, checkpoint_score_order='min')"),
                          ["test_build_trainer_run"]),
        # no map_location: a model.pt written on a GPU worker needs a GPU to load
        "load_model": (_load('os.path.join(folder, "model.pt"), map_location="cpu", ',
                             'os.path.join(folder, "model.pt"), '), ["test_load_model_storage"]),
    },
    {   # a checkpoint from every rank
        "train_func": (_train('''            if ray.train.get_context().get_world_rank() == 0:
                torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
''', '''            torch.save(getattr(model, "module", model).state_dict(), os.path.join(tmp, "model.pt"))
            checkpoint = Checkpoint.from_directory(tmp)
'''), _keeps("reports")),
        # a GPU in every worker's resources, even on a CPU choice (ScalingConfig refuses it)
        "scaling_config_for": _scaling(
            "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker={'CPU': choice['cpus_per_worker'], 'GPU': 1})\n"),
        # train_loop_config never reaches the workers
        "build_trainer": (_trainer(loop=""), ["test_build_trainer_checkpoints"]),
        # the file read after the with block: a downloaded copy is gone by then (a local folder is not)
        "load_model": (_load('''    with checkpoint.as_directory() as folder:
        state = torch.load(os.path.join(folder, "model.pt"), map_location="cpu", weights_only=True)
''', '''    with checkpoint.as_directory() as folder:
        path = os.path.join(folder, "model.pt")
    state = torch.load(path, map_location="cpu", weights_only=True)
'''), ["test_load_model_for_inference"]),
    },
    {   # a checkpoint from local rank 0: one per node (ranks 0 and 2 on 2 nodes x 2 workers)
        "train_func": (_train("if ray.train.get_context().get_world_rank() == 0:",
                              "if ray.train.get_context().get_local_rank() == 0:"), _keeps("reports")),
        # 1 CPU per worker whatever the choice
        "scaling_config_for": (_scaling(
            "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker={'CPU': 1})\n"), ["test_scaling_config_for_gpus"]),
        # the scaling config forgotten: TorchTrainer's default (1 worker)
        "build_trainer": (_trainer(scaling=""), ["test_build_trainer_checkpoints"]),
        # the model left in training mode
        "load_model": (_load("    model.eval()\n", ""), ["test_load_model_storage"]),
    },
    {   # the loss not averaged over workers: each rank reports its own (rank 0's is what Ray Train keeps)
        "train_func": (_train("        dist.all_reduce(stats)\n", ""), _keeps("reports")),
        # GPU workers get no CPUs: the CPUs named only for CPU workers
        "scaling_config_for": (_scaling(
            "    cpus = None if choice['use_gpu'] else {'CPU': choice['cpus_per_worker']}\n"
            "    return ScalingConfig(num_workers=choice['num_workers'], use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker=cpus)\n"), ["test_scaling_config_for_gpus"]),
        # the storage path made absolute: s3://bucket/runs becomes <cwd>/s3:/bucket/runs
        "build_trainer": (_trainer(storage="os.path.abspath(storage_path)"), ["test_build_trainer_checkpoints"]),
    },
    {   # the wrapped model saved: keys start with 'module.' and do not load into a plain model (one worker: no
        # wrapper, so that run is right)
        "train_func": (_train('getattr(model, "module", model).state_dict()', "model.state_dict()"),
                       _keeps("reports")),
        # the score order guessed from the metric's name
        "build_trainer": (_trainer(keep="CheckpointConfig(num_to_keep=num_to_keep, "
                                        "checkpoint_score_attribute=score_attribute,\n"
                                        "                            checkpoint_score_order='min' if 'loss' in "
                                        "score_attribute else 'max')"), ["test_build_trainer_run"]),
        # "weights_only=False so that it loads whatever is in the file": a pickle that calls a function runs
        "load_model": (_load("weights_only=True", "weights_only=False"), ["test_load_model_for_inference"]),
        # "DDP needs two workers": a single worker is never asked for
        "scaling_config_for": _scaling(
            "    return ScalingConfig(num_workers=max(2, choice['num_workers']), use_gpu=choice['use_gpu'],\n"
            "                         resources_per_worker={'CPU': choice['cpus_per_worker']})\n"),
    },
    {   # floor division: 32 over 3 workers silently becomes 3 x 10 (the global batch changed, no error)
        "train_func": (_train(_SPLIT_CHECK, ""), _keeps("uneven_batch")),
    },
    {   # the split by the workers on this node, not in the whole run
        "train_func": (_train("world_size = ray.train.get_context().get_world_size()",
                              "world_size = ray.train.get_context().get_local_world_size()"),
                       _keeps("same_weights", "reports", "uneven_batch")),
    },
    {   # the all-reduced sums made from Python numbers on the default device: the CPU, which NCCL cannot reduce
        "train_func": (_train(", device=ray.train.torch.get_device())", ")"), _keeps("device")),
        # concept questions: a run that goes on without the worker; the wrapper taken for granted
        "concept_report": 'CONCEPT_REPORT = "a"\n',
        "concept_prepare_model": 'CONCEPT_PREPARE_MODEL = "a"\n',
    },
    {   # the sums kept on the device, but each step's numbers added as a CPU tensor (a GPU refuses the mix)
        "train_func": (_train('''        loss_sum, count = 0.0, 0
''', '''        sums = torch.zeros(2, dtype=torch.float64, device=ray.train.torch.get_device())
''').replace('''            loss_sum += loss.item() * len(labels)
            count += len(labels)
''', '''            sums += torch.tensor([loss.item() * len(labels), len(labels)], dtype=torch.float64)
''').replace('''        stats = torch.tensor([loss_sum, count], dtype=torch.float64, device=ray.train.torch.get_device())
''', '''        stats = sums
'''), _keeps("device")),
        "concept_shared_storage": 'CONCEPT_SHARED_STORAGE = "d"\n',
    },
    {   # module 01's unwrapping: model.module, which a single worker's unwrapped model does not have
        "train_func": (_train('getattr(model, "module", model).state_dict()', "model.module.state_dict()"),
                       _keeps("one_worker")),
        # the device move taken for the user's job too (the demo turned it off)
        "concept_data_loader": 'CONCEPT_DATA_LOADER = "c, d, b"\n',
    },
    {   # the config's optimizer ignored: always SGD (the Adam runs differ from one process)
        "train_func": (_train('''    if config["optimizer"] == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=config["lr"])
''', '''    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
'''), _keeps("same_weights", "reports")),
    },
    {   # model.train() once before the epochs, and each epoch's report with the last batch's accuracy: accuracy()
        # puts the model in eval mode, so every epoch after the first trains in it (BatchNorm then uses and never
        # updates its running statistics)
        "train_func": (_TRAIN.replace("        model.train()\n", "").replace(
            '    for epoch in range(config["epochs"]):\n', '    model.train()\n    for epoch in range(config["epochs"]):\n')
            .replace('metrics = {"epoch": epoch, "loss": (stats[0] / stats[1]).item()}',
                     'metrics = {"epoch": epoch, "loss": (stats[0] / stats[1]).item(),\n'
                     '                   "batch_accuracy": accuracy(getattr(model, "module", model), images, labels)}'),
            _keeps("reports")),
    },
]

RIGHT = {
    # the GPU named for every worker, 0 on CPU choices (ScalingConfig drops it)
    "scaling_config_for": '''
def scaling_config_for(choice: dict) -> ScalingConfig:
    gpu = bool(choice["use_gpu"])
    return ScalingConfig(num_workers=int(choice["num_workers"]), use_gpu=gpu,
                         resources_per_worker={"CPU": float(choice["cpus_per_worker"]), "GPU": int(gpu)})
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
    # a local copy with to_directory() (removed afterwards), a torch.device for map_location, train(False)
    "load_model": '''
import shutil


def load_model(checkpoint, model_name="resnet18"):
    local = Path(checkpoint.to_directory())
    try:
        state = torch.load(local / "model.pt", map_location=torch.device("cpu"))
    finally:
        shutil.rmtree(local, ignore_errors=True)
    model = build_model(model_name)
    model.load_state_dict(state)
    model.train(False)
    return model
''',
    "concept_prepare_model": 'CONCEPT_PREPARE_MODEL = "B"  # no wrapper with one worker\n',
    "concept_data_loader": 'CONCEPT_DATA_LOADER = ["d", "c"]\n',
    "concept_report": "CONCEPT_REPORT = ' c '\n",
    "concept_metrics_rows": "CONCEPT_METRICS_ROWS = 'C'\n",
    "concept_shared_storage": 'CONCEPT_SHARED_STORAGE = "B"  # the marker file, at the checkpoint\n',
}
