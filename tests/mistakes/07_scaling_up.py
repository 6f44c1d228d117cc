"""Realistic mistakes in module 07's capstone (grade_id -> what a student might write).

The capstone ports a plain script whose model does not fit one worker's memory budget to FSDP2 under Ray Train.
Each mistake is the port written correctly except for one thing, so that the test cells must catch that one thing.
``_PORT`` is a correct port in the reference's shape; the mistakes are edits of it (each edit is checked to apply).
A mistake written as ``(code, cells)`` keeps the points of ``cells``: checks of things it gets right (its pitfall
is another cell's), and must lose every other ``test_train_func_*`` cell."""

_PORT = '''
def train_func(config):
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    device = ray.train.torch.get_device()
    with torch.device("meta"):
        net = build_net(config)
    mesh = init_device_mesh(device.type, (world_size,))
    for layer in net.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    net.to_empty(device=device)
    start = build_net(config).state_dict() if rank == 0 else {}
    set_model_state_dict(net, start, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    adamw = torch.optim.AdamW(net.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    first_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        weights, optimizer_state = get_state_dict(net, adamw)
        state = {"model": weights, "optimizer": optimizer_state, "epoch": -1}
        with checkpoint.as_directory() as folder:
            dcp.load(state, checkpoint_id=folder)
        set_state_dict(net, adamw, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        first_epoch = state["epoch"] + 1
    train_set = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=config["seed"])
    batches = DataLoader(train_set, batch_size=config["batch_size"] // world_size, sampler=sampler, drop_last=True)
    for epoch in range(first_epoch, config["epochs"]):
        sampler.set_epoch(epoch)
        net.train()
        totals = torch.zeros(2, device=device)
        for images, labels in batches:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(net(images), labels)
            adamw.zero_grad()
            loss.backward()
            adamw.step()
            totals += torch.tensor([loss.item() * len(labels), len(labels)], device=device)
        dist.all_reduce(totals)
        metrics = {"epoch": epoch, "loss": (totals[0] / totals[1]).item()}
        with tempfile.TemporaryDirectory() as folder:
            weights, optimizer_state = get_state_dict(net, adamw)
            dcp.save({"model": weights, "optimizer": optimizer_state, "epoch": epoch}, checkpoint_id=folder)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
'''

CELLS = ("matches_one_process", "loss", "memory_budget", "layers_sharded", "built_on_meta", "checkpoint", "resume",
         "one_worker")


def _edit(code: str, old: str, new: str) -> str:
    assert code.count(old) == 1, f"the mistake's edit does not apply: {old!r}"
    return code.replace(old, new)


def _keeps(code: str, *lost: str):
    """The mistake with every test_train_func_* cell kept except those of ``lost`` (its pitfall)."""
    assert set(lost) <= set(CELLS), lost
    return code, [f"test_train_func_{c}" for c in CELLS if c not in lost]


# --- the strategy ------------------------------------------------------------------------------------------------
# the module-02 port the old capstone asked for: DDP (prepare_model) and a rank-0 checkpoint; it computes the
# script's weights and loss, but every rank holds the whole model, and it never resumes
DDP_PORT = _keeps('''
def train_func(config):
    context = ray.train.get_context()
    world_size = context.get_world_size()
    net = ray.train.torch.prepare_model(build_net(config))
    adamw = torch.optim.AdamW(net.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    train_set = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=context.get_world_rank(),
                                 seed=config["seed"])
    batches = DataLoader(train_set, batch_size=config["batch_size"] // world_size, sampler=sampler, drop_last=True)
    for epoch in range(config["epochs"]):
        sampler.set_epoch(epoch)
        totals = torch.zeros(2)
        for images, labels in batches:
            loss = F.cross_entropy(net(images), labels)
            adamw.zero_grad()
            loss.backward()
            adamw.step()
            totals += torch.tensor([loss.item() * len(labels), len(labels)])
        dist.all_reduce(totals)
        with tempfile.TemporaryDirectory() as folder:
            checkpoint = None
            if context.get_world_rank() == 0:
                torch.save({"model": getattr(net, "module", net).state_dict(), "optimizer": adamw.state_dict(),
                            "epoch": epoch}, os.path.join(folder, "checkpoint.pt"))
                checkpoint = Checkpoint.from_directory(folder)
            ray.train.report({"epoch": epoch, "loss": (totals[0] / totals[1]).item()}, checkpoint=checkpoint)
''', "memory_budget", "layers_sharded", "built_on_meta", "checkpoint", "resume")
# the whole model built on every rank, then sharded (the old capstone's way): trains like the script, within the
# budget from the first step on, but every rank held the whole model first
EAGER_BUILD = _keeps(_edit(_edit(_PORT, '''    with torch.device("meta"):
        net = build_net(config)
''', "    net = build_net(config).to(device)\n"), '''    net.to_empty(device=device)
    start = build_net(config).state_dict() if rank == 0 else {}
    set_model_state_dict(net, start, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
''', ""), "built_on_meta")
# built on the meta device, but every rank builds the script's whole model to load its shards from: no rank 0 to
# hand them out, so every rank holds the whole model once
EVERY_RANK_BUILDS = _keeps(_edit(_PORT, '''    start = build_net(config).state_dict() if rank == 0 else {}
    set_model_state_dict(net, start, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))''',
    '''    set_model_state_dict(net, build_net(config).state_dict(), options=StateDictOptions(full_state_dict=True))'''),
    "built_on_meta")
# built on the meta device and initialised there with the seed (module 05's fresh build): no rank holds the whole
# model, but on several ranks the shards are not the script's starting weights (on one worker they are: its shards
# are the whole tensors, drawn in the script's order)
FRESH_INIT = _keeps(_edit(_PORT, '''    start = build_net(config).state_dict() if rank == 0 else {}
    set_model_state_dict(net, start, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))''',
    '''    torch.manual_seed(config["seed"])
    for module in net.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()'''), "matches_one_process", "loss", "resume")
# one fully_shard on the root only: parameters, gradients and AdamW's state are sharded between steps (under the
# budget), but the forward pass gathers every layer at once
ROOT_ONLY = _keeps(_edit(_PORT, "    for layer in net.layers:\n        fully_shard(layer, mesh=mesh)\n", ""),
                   "layers_sharded")
# keeps every layer gathered after its forward pass (the option module 05 showed for speed)
NO_RESHARD = _keeps(_edit(_PORT, "fully_shard(layer, mesh=mesh)", "fully_shard(layer, mesh=mesh, reshard_after_forward=False)"),
                    "layers_sharded")
# AdamW built before sharding: it holds the tensors fully_shard replaced, and the model never learns
OPTIMIZER_FIRST = _keeps(_edit(_edit(
    _PORT, '    adamw = torch.optim.AdamW(net.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])\n', ""),
    "    mesh = init_device_mesh(",
    '    adamw = torch.optim.AdamW(net.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])\n'
    "    mesh = init_device_mesh("), "matches_one_process", "loss", "memory_budget", "resume")
# the mesh written for a GPU machine's device... for this one: a literal device type
LITERAL_DEVICE = _keeps(_edit(_PORT, "init_device_mesh(device.type, (world_size,))", 'init_device_mesh("cpu", (world_size,))'),
                        "layers_sharded")

# --- data and loss -----------------------------------------------------------------------------------------------
# every worker takes the script's global batch: 4 x the examples per step, 4 x fewer steps
GLOBAL_BATCH = _keeps(_edit(_PORT, 'batch_size=config["batch_size"] // world_size', 'batch_size=config["batch_size"]'),
                      "matches_one_process", "loss", "resume")
# reports its own shard's loss: no all-reduce
LOSS_NOT_AVERAGED = _keeps(_edit(_PORT, "        dist.all_reduce(totals)\n", ""), "loss")
# prepare_data_loader's sampler told the epoch without a guard: with one worker there is no DistributedSampler
UNGUARDED_SET_EPOCH = _keeps(_edit(_edit(
    _PORT, '''    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=config["seed"])
    batches = DataLoader(train_set, batch_size=config["batch_size"] // world_size, sampler=sampler, drop_last=True)''',
    '''    batches = ray.train.torch.prepare_data_loader(
        DataLoader(train_set, batch_size=config["batch_size"] // world_size, shuffle=True, drop_last=True))'''),
    "        sampler.set_epoch(epoch)\n", "        batches.sampler.set_epoch(epoch)\n"), "one_worker")

# --- checkpoints -------------------------------------------------------------------------------------------------
# the DDP habit: only rank 0 saves, with torch.save, its own model.state_dict() (its shards of each DTensor)
RANK0_TORCH_SAVE = _keeps(_edit(_PORT, '''            weights, optimizer_state = get_state_dict(net, adamw)
            dcp.save({"model": weights, "optimizer": optimizer_state, "epoch": epoch}, checkpoint_id=folder)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))''', '''            checkpoint = None
            if rank == 0:
                torch.save({"model": net.state_dict(), "optimizer": adamw.state_dict(), "epoch": epoch},
                           os.path.join(folder, "checkpoint.pt"))
                checkpoint = Checkpoint.from_directory(folder)
            ray.train.report(metrics, checkpoint=checkpoint)'''), "checkpoint", "resume", "one_worker")
# only rank 0 calls the collective DCP save (on a cluster it waits forever for the others)
RANK0_DCP_SAVE = _keeps(_edit(_PORT, '''            dcp.save({"model": weights, "optimizer": optimizer_state, "epoch": epoch}, checkpoint_id=folder)
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))''', '''            if rank == 0:
                dcp.save({"model": weights, "optimizer": optimizer_state, "epoch": epoch}, checkpoint_id=folder)
                ray.train.report(metrics, checkpoint=Checkpoint.from_directory(folder))
            else:
                ray.train.report(metrics)'''), "checkpoint", "resume")
# every rank gathers the full state dict (module 05's export for inference) and saves it with DCP: no rank may
# hold the whole model, and the checkpoint holds whole tensors
FULL_STATE_EVERY_RANK = _keeps(_edit(_PORT, '''            weights, optimizer_state = get_state_dict(net, adamw)
            dcp.save(''', '''            weights, optimizer_state = get_state_dict(net, adamw, options=StateDictOptions(full_state_dict=True))
            dcp.save('''), "checkpoint")
# ignores the checkpoint Ray Train hands back: a restarted run starts again from epoch 0
NO_RESUME = _keeps(_edit(_PORT, "    checkpoint = ray.train.get_checkpoint()\n", "    checkpoint = None\n"), "resume")
# resumes the weights only: AdamW's moments and step count start again
RESUME_MODEL_ONLY = _keeps(_edit(_edit(
    _PORT, '''        weights, optimizer_state = get_state_dict(net, adamw)
        state = {"model": weights, "optimizer": optimizer_state, "epoch": -1}''',
    '''        state = {"model": get_state_dict(net, adamw)[0], "epoch": -1}'''),
    '''        set_state_dict(net, adamw, model_state_dict=state["model"], optim_state_dict=state["optimizer"])''',
    '''        net.load_state_dict(state["model"])'''), "resume")

# loads from the checkpoint's path as if it were a local folder (on a run's storage, S3 or NFS, it is not)
RESUME_FROM_PATH = _keeps(_edit(_PORT, """        with checkpoint.as_directory() as folder:
            dcp.load(state, checkpoint_id=folder)""", """        dcp.load(state, checkpoint_id=checkpoint.path)"""), "resume")

WRONG = {"train_func": DDP_PORT, "concept_when_to_shard": 'CONCEPT_WHEN_TO_SHARD = "a b c"',
         "concept_shared_storage": 'CONCEPT_SHARED_STORAGE = "b"'}

MORE_WRONG = [
    {"train_func": ROOT_ONLY, "concept_cluster_layout": 'CONCEPT_CLUSTER_LAYOUT = "a c d"'},
    {"train_func": OPTIMIZER_FIRST, "concept_job_submission": 'CONCEPT_JOB_SUBMISSION = "a b c"'},
    {"train_func": GLOBAL_BATCH, "concept_when_to_shard": 'CONCEPT_WHEN_TO_SHARD = "a"'},
    {"train_func": LOSS_NOT_AVERAGED},
    {"train_func": UNGUARDED_SET_EPOCH},
    {"train_func": RANK0_TORCH_SAVE},
    {"train_func": RANK0_DCP_SAVE},
    {"train_func": FULL_STATE_EVERY_RANK},
    {"train_func": NO_RESUME},
    {"train_func": RESUME_MODEL_ONLY},
    {"train_func": NO_RESHARD},
    {"train_func": LITERAL_DEVICE},
    {"train_func": RESUME_FROM_PATH},
    {"train_func": EAGER_BUILD},
    {"train_func": EVERY_RANK_BUILDS},
    {"train_func": FRESH_INIT},
]

# Correct, written differently from the reference: the meta build with the rank from torch.distributed and the state
# dict by keyword, the sampler's rank and world size from its process group (its
# defaults), the rank and world size from torch.distributed, get_checkpoint imported by name, fully_shard with its
# default spelled out, the model's and the optimizer's state dicts through their own functions, the loss summed as
# tensors, a folder from mkdtemp; answers to the questions written with commas and capitals.
RIGHT = {
    "train_func": '''
from ray.train import get_checkpoint
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)


def train_func(config):
    world = dist.get_world_size()
    device = ray.train.torch.get_device()
    with torch.device("meta"):
        model = build_net(config)
    ranks = init_device_mesh(ray.train.torch.get_device().type, mesh_shape=(world,))
    for block in model.layers:
        fully_shard(block, mesh=ranks, reshard_after_forward=True)
    model = fully_shard(model, mesh=ranks)
    model.to_empty(device=device)
    full = {} if dist.get_rank() else build_net(config).state_dict()
    set_model_state_dict(model, model_state_dict=full,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"], weight_decay=config["weight_decay"])
    start = 0
    restored = get_checkpoint()
    if restored is not None:
        state = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer),
                 "epoch": 0}
        with restored.as_directory() as path:
            dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
        start = int(state["epoch"]) + 1
    data = load_digits(train=True, limit=config["train_samples"], quiet=True).dataset()
    order = DistributedSampler(data, shuffle=True, seed=config["seed"], drop_last=False)
    loader = DataLoader(data, batch_size=config["batch_size"] // world, sampler=order, drop_last=True)
    for epoch in range(start, config["epochs"]):
        order.set_epoch(epoch)
        loss_total = torch.zeros((), device=device)
        examples = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            loss_total += loss.detach() * y.shape[0]
            examples += y.shape[0]
        both = torch.stack([loss_total, examples])
        dist.all_reduce(both, op=dist.ReduceOp.SUM)
        folder = tempfile.mkdtemp()
        dcp.save({"epoch": epoch, "model": get_model_state_dict(model),
                  "optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=folder)
        ray.train.report({"loss": float(both[0] / both[1]), "epoch": epoch}, checkpoint=Checkpoint.from_directory(folder))
''',
    "concept_when_to_shard": 'CONCEPT_WHEN_TO_SHARD = "C, A"',
    "concept_cluster_layout": 'CONCEPT_CLUSTER_LAYOUT = "c,a"',
    "concept_shared_storage": 'CONCEPT_SHARED_STORAGE = "A"',
    "concept_job_submission": 'CONCEPT_JOB_SUBMISSION = "C,a"',
}
