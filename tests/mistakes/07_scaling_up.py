"""Realistic mistakes in module 07's capstone (grade_id -> what a student might write).

Each mistake is the port written correctly except for one thing, so that the test cells must catch that one
thing. ``_PORT`` is a correct port in the reference's shape; the mistakes are edits of it (each edit is checked
to apply)."""

_PORT = '''
def train_func(config):
    context = ray.train.get_context()
    world_size = context.get_world_size()
    net = ray.train.torch.prepare_model(build_net(config))
    sgd = torch.optim.SGD(net.parameters(), lr=config["lr"], momentum=0.9, weight_decay=config["weight_decay"])
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(sgd, T_max=config["epochs"])
    train_set = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    loader = DataLoader(train_set, batch_size=config["batch_size"] // world_size, shuffle=True, drop_last=True)
    loader = ray.train.torch.prepare_data_loader(loader)
    for epoch in range(config["epochs"]):
        if world_size > 1:
            loader.sampler.set_epoch(epoch)
        net.train()
        total = torch.zeros(2, device=ray.train.torch.get_device())
        for images, labels in loader:
            loss = F.cross_entropy(net(images), labels, label_smoothing=config["label_smoothing"])
            sgd.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), config["max_grad_norm"])
            sgd.step()
            total += torch.tensor([loss.item() * len(labels), len(labels)], device=total.device)
        schedule.step()
        dist.all_reduce(total)
        metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item()}
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = None
            if context.get_world_rank() == 0:
                torch.save({"model": net.module.state_dict(), "optimizer": sgd.state_dict(),
                            "scheduler": schedule.state_dict(), "epoch": epoch}, os.path.join(tmp, "checkpoint.pt"))
                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)
'''

_DRIVER = '''
def build_trainer(train_loop, config, num_workers, use_gpu, cpus_per_worker, storage, name):
    scaling = ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker={"CPU": cpus_per_worker})
    run = RunConfig(name=name, storage_path=storage, checkpoint_config=CheckpointConfig(num_to_keep=2))
    return TorchTrainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run)
'''


def _edit(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the mistake's edit does not apply: {old!r}"
    return code.replace(old, new)


# --- train_func ------------------------------------------------------------------------------
# forgets set_epoch: every epoch visits the examples in epoch 0's order
NO_SET_EPOCH = _edit(_PORT, "        if world_size > 1:\n            loader.sampler.set_epoch(epoch)\n", "")
# gives every worker the script's global batch (N x the examples per step, N x fewer steps)
GLOBAL_BATCH = _edit(_PORT, 'batch_size=config["batch_size"] // world_size', 'batch_size=config["batch_size"]')
# divides the global batch by the workers of its own node: right on one node, wrong on several
LOCAL_BATCH = _edit(_PORT, 'batch_size=config["batch_size"] // world_size',
                    'batch_size=config["batch_size"] // context.get_local_world_size()')
# checkpoints on every worker (the DDP habit taken from FSDP: N copies of the same file)
EVERY_RANK_CHECKPOINTS = _edit(_PORT, "            if context.get_world_rank() == 0:\n",
                               "            if True:\n")
# rank 0 of each node checkpoints: the local rank mistaken for the world rank
LOCAL_RANK_CHECKPOINTS = _edit(_PORT, "context.get_world_rank() == 0", "context.get_local_rank() == 0")
# reports its own shard's loss: no all-reduce
LOSS_NOT_AVERAGED = _edit(_PORT, "        dist.all_reduce(total)\n", "")
# all-reduces the workers' mean losses and forgets to divide by the number of workers
LOSS_SUMMED = _edit(_PORT, '''        dist.all_reduce(total)
        metrics = {"epoch": epoch, "loss": (total[0] / total[1]).item()}''', '''        mean = total[0:1] / total[1]
        dist.all_reduce(mean)
        metrics = {"epoch": epoch, "loss": mean.item()}''')
# shards the data but never wraps the model in DDP: gradients are not averaged, the workers drift apart
MODEL_NOT_PREPARED = _edit(_edit(_PORT, "net = ray.train.torch.prepare_model(build_net(config))",
                                 "net = build_net(config)"),
                           '"model": net.module.state_dict()', '"model": net.state_dict()')
# saves DDP's state dict: every key starts with 'module.', the plain model cannot load it
WRAPPED_STATE_DICT = _edit(_PORT, '"model": net.module.state_dict()', '"model": net.state_dict()')
# only rank 0 calls ray.train.report (on Ray Train the other workers' reports are what the run waits for)
ONLY_RANK0_REPORTS = _edit(_PORT, '''                checkpoint = Checkpoint.from_directory(tmp)
            ray.train.report(metrics, checkpoint=checkpoint)''', '''                checkpoint = Checkpoint.from_directory(tmp)
                ray.train.report(metrics, checkpoint=checkpoint)''')

# --- build_trainer ---------------------------------------------------------------------------
# forgets the storage: the run goes to the default local folder (each node's own ~/ray_results)
NO_STORAGE = _edit(_DRIVER, "storage_path=storage, ", "")
# ignores cpus_per_worker (a GPU worker then reserves no CPU for its data loading)
NO_CPUS = _edit(_DRIVER, ', resources_per_worker={"CPU": cpus_per_worker}', "")
# keeps every checkpoint
NO_NUM_TO_KEEP = _edit(_DRIVER, ", checkpoint_config=CheckpointConfig(num_to_keep=2)", "")
# always asks for a GPU in the resources (fails on CPU workers: use_gpu=False with a GPU resource)
GPU_ALWAYS = _edit(_DRIVER, 'resources_per_worker={"CPU": cpus_per_worker}',
                   'resources_per_worker={"CPU": cpus_per_worker, "GPU": 1}')
# hard-codes the GPU choice of the machine it was written on
USE_GPU_IGNORED = _edit(_DRIVER, "use_gpu=use_gpu", "use_gpu=False")

WRONG = {"train_func": NO_SET_EPOCH, "build_trainer": NO_STORAGE}

MORE_WRONG = [
    {"train_func": GLOBAL_BATCH, "build_trainer": NO_CPUS},
    {"train_func": EVERY_RANK_CHECKPOINTS, "build_trainer": NO_NUM_TO_KEEP},
    {"train_func": LOSS_NOT_AVERAGED, "build_trainer": GPU_ALWAYS},
    {"train_func": MODEL_NOT_PREPARED, "build_trainer": USE_GPU_IGNORED},
    {"train_func": LOCAL_RANK_CHECKPOINTS},
    {"train_func": WRAPPED_STATE_DICT},
    {"train_func": ONLY_RANK0_REPORTS},
    {"train_func": LOCAL_BATCH},
    {"train_func": LOSS_SUMMED},
]

# Correct, written differently from the reference: DDP and the DistributedSampler by hand, the rank from
# torch.distributed, the loss summed as tensors, reports without a checkpoint argument on the other ranks; a
# driver with keyword arguments and the GPU spelled out in the resources.
RIGHT = {
    "train_func": '''
from torch.nn.parallel import DistributedDataParallel


def train_func(config):
    rank, world = dist.get_rank(), dist.get_world_size()
    device = ray.train.torch.get_device()
    model = DistributedDataParallel(build_net(config).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9,
                                weight_decay=config["weight_decay"])
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=config["epochs"])
    data = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=config["seed"])
    loader = DataLoader(data, batch_size=config["batch_size"] // world, sampler=sampler, drop_last=True)
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        model.train()
        loss_total = torch.zeros((), device=device)
        examples = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y, label_smoothing=config["label_smoothing"])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=config["max_grad_norm"])
            optimizer.step()
            loss_total += loss.detach() * y.shape[0]
            examples += y.shape[0]
        scheduler.step()
        both = torch.stack([loss_total, examples])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        mean_loss = float(both[0] / both[1])
        if rank == 0:
            folder = tempfile.mkdtemp()
            torch.save({"epoch": epoch, "model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict()}, os.path.join(folder, "checkpoint.pt"))
            ray.train.report({"loss": mean_loss, "epoch": epoch}, checkpoint=Checkpoint.from_directory(folder))
        else:
            ray.train.report({"loss": mean_loss, "epoch": epoch})
''',
    "build_trainer": '''
def build_trainer(train_loop, config, num_workers, use_gpu, cpus_per_worker, storage, name):
    resources = {"CPU": cpus_per_worker}
    if use_gpu:
        resources["GPU"] = 1
    return TorchTrainer(
        train_loop_per_worker=train_loop,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu, resources_per_worker=resources),
        run_config=RunConfig(storage_path=storage, name=name,
                             checkpoint_config=CheckpointConfig(num_to_keep=2)),
    )
''',
}
