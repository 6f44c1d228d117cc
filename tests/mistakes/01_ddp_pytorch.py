"""Realistic mistakes in module 01 (grade_id -> what a student might write), and right answers written
differently from the reference.

tests/test_grading.py grades a submission made of the reference answers with these replacing some of them:
every exercise named in a WRONG / MORE_WRONG student must lose the points of its test cells, except those named
with it (a mistake written as (code, cells) keeps the points of the cells that check what it gets right); RIGHT must
keep full marks. The hidden tests run on 4 gloo ranks simulated as 2 nodes x 2 (LOCAL_RANK = rank % 2) and on 1 process.

Each exercise has three graded cells, one per pitfall:
    sharded_epochs:  _shards (sizes, batches, coverage), _global_rank (2 nodes x 2), _order (seed, set_epoch)
    train_step:      _weights (the DDP step), _loss (the loss over all ranks, a float), _device (the loss's device)
    save_checkpoint: _contents (the file), _rank0 (who writes), _barrier (every rank waits, with a collective)
"""

# ------------------------------------------------------------------------------------------ sharded_epochs
SHARDED_NO_SET_EPOCH = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    sampler = DistributedSampler(dataset, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        yield epoch, loader          # forgot sampler.set_epoch(epoch): every epoch in the same order
'''

SHARDED_LOCAL_RANK = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    # the rank and world size of this node (torchrun's LOCAL_*), not of the job
    sampler = DistributedSampler(dataset, num_replicas=int(os.environ["LOCAL_WORLD_SIZE"]),
                                 rank=int(os.environ["LOCAL_RANK"]), shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch, loader
'''

SHARDED_ONLY_LOCAL_RANK = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    sampler = DistributedSampler(dataset, num_replicas=dist.get_world_size(),
                                 rank=int(os.environ["LOCAL_RANK"]), seed=seed)   # local rank as the rank
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch, loader
'''

SHARDED_NO_SAMPLER = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    torch.manual_seed(seed)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)   # every rank reads all the data
    for epoch in range(epochs):
        yield epoch, loader
'''

SHARDED_SET_EPOCH_TOO_LATE = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    sampler = DistributedSampler(dataset, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        yield epoch, loader
        sampler.set_epoch(epoch)     # after the epoch: epoch 1 repeats epoch 0's order
'''

SHARDED_GLOBAL_BATCH_SPLIT = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    sampler = DistributedSampler(dataset, seed=seed)
    # batch_size is already the per-worker batch; dividing it again shrinks every batch
    loader = DataLoader(dataset, batch_size=max(1, batch_size // dist.get_world_size()), sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch, loader
'''

SHARDED_SEED_IGNORED = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    sampler = DistributedSampler(dataset, shuffle=True)      # the seed argument is never used
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch, loader
'''

SHARDED_ALONE_UNSEEDED = '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    if dist.get_world_size() == 1:   # alone: nothing to shard, a plain shuffled loader (the seed is lost)
        loader = DataLoader(dataset, batch_size=batch_size, shuffle=True)
        for epoch in range(epochs):
            yield epoch, loader
        return
    sampler = DistributedSampler(dataset, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        yield epoch, loader
'''

# ------------------------------------------------------------------------------------------ train_step
STEP_LOCAL_LOSS = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    return loss.item()               # this rank's loss only, never averaged over the ranks
'''

STEP_UNWRAPPED = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model.module(images), labels)   # bypasses DDP: gradients never averaged
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
'''

STEP_SUM_NOT_MEAN = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item()              # the sum over the ranks, not their mean
'''

STEP_SCALED_LOSS = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    (loss / dist.get_world_size()).backward()   # "DDP sums the gradients": but it averages them already
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
'''

STEP_NO_ZERO_GRAD = '''
def train_step(ddp_model, optimizer, images, labels):
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()                  # gradients of earlier steps are still there: they accumulate
    optimizer.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()
'''

STEP_RANK0_LOSS = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    reported = loss.detach().clone()
    dist.broadcast(reported, src=0)  # everybody agrees, on rank 0's loss
    return reported.item()
'''

STEP_CPU_TENSOR = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    mean = torch.tensor([loss.item()])           # on the CPU: an NCCL group (GPUs) refuses it
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return float(mean[0])
'''

STEP_HARDCODED_CPU = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    reported = loss.detach().to("cpu")           # "gloo wants CPU tensors": NCCL, on GPUs, wants GPU ones
    dist.all_reduce(reported)
    return reported.item() / dist.get_world_size()
'''

STEP_TENSOR_WHEN_ALONE = '''
def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp_model(images), labels)
    loss.backward()
    optimizer.step()
    if dist.get_world_size() == 1:
        return loss                                # alone: "nothing to average" (but a tensor, not a float)
    reported = loss.detach().clone()
    dist.all_reduce(reported)
    return reported.item() / dist.get_world_size()
'''

# ------------------------------------------------------------------------------------------ save_checkpoint
SAVE_LOCAL_RANK_0 = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if int(os.environ["LOCAL_RANK"]) == 0:    # 0 on every node: two writers on 2 nodes
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, path)
    dist.barrier()
'''

SAVE_NO_BARRIER = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, path)
    # no barrier: the other ranks run on before the file exists
'''

SAVE_BARRIER_ON_RANK0_ONLY = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, path)
        dist.barrier()               # only rank 0 reaches it: it waits for ranks that never come
'''

SAVE_WRAPPED_KEYS = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.state_dict(),      # keys prefixed with "module."
                    "optimizer": optimizer.state_dict(), "epoch": epoch}, path)
    dist.barrier()
'''

SAVE_EVERY_RANK = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    # every rank writes (the same file, concurrently, on shared storage)
    torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                "epoch": epoch}, path)
    dist.barrier()
'''

SAVE_POLL_FOR_FILE = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, path)
    else:
        while not os.path.exists(path):   # wait for rank 0's file (it exists before it is complete)
            time.sleep(0.05)
'''

SAVE_BARRIER_FIRST = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    dist.barrier()                    # everybody here: now rank 0 writes (the others leave at once)
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch}, path)
'''

SAVE_OBJECTS = '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if dist.get_rank() == 0:
        torch.save({"model": ddp_model.module, "optimizer": optimizer, "epoch": epoch}, path)   # the objects
    dist.barrier()
'''

# the cells each mistake may keep: they check what it gets right
SHARDS_RIGHT = ("test_sharded_epochs_shards", "test_sharded_epochs_global_rank")
ONE_NODE_RIGHT = ("test_sharded_epochs_shards", "test_sharded_epochs_order")   # local rank = global rank on 1 node
STEP_RIGHT = ("test_train_step_weights", "test_train_step_device")
LOSS_RIGHT = ("test_train_step_weights", "test_train_step_loss")
DEVICE_RIGHT = ("test_train_step_device",)
FILE_RIGHT = ("test_save_checkpoint_contents", "test_save_checkpoint_barrier")
WRITER_RIGHT = ("test_save_checkpoint_contents", "test_save_checkpoint_rank0")

WRONG = {
    "sharded_epochs": (SHARDED_NO_SET_EPOCH, SHARDS_RIGHT),
    "train_step": (STEP_LOCAL_LOSS, STEP_RIGHT),
    "save_checkpoint": (SAVE_LOCAL_RANK_0, FILE_RIGHT),
}

MORE_WRONG = [
    {"sharded_epochs": (SHARDED_LOCAL_RANK, ONE_NODE_RIGHT),
     "train_step": (STEP_UNWRAPPED, DEVICE_RIGHT),
     "save_checkpoint": (SAVE_NO_BARRIER, WRITER_RIGHT)},
    {"sharded_epochs": SHARDED_NO_SAMPLER,
     "train_step": (STEP_SUM_NOT_MEAN, STEP_RIGHT),
     "save_checkpoint": (SAVE_BARRIER_ON_RANK0_ONLY, WRITER_RIGHT)},
    {"sharded_epochs": (SHARDED_SET_EPOCH_TOO_LATE, SHARDS_RIGHT),
     "train_step": (STEP_SCALED_LOSS, DEVICE_RIGHT),
     "save_checkpoint": (SAVE_WRAPPED_KEYS, ("test_save_checkpoint_rank0", "test_save_checkpoint_barrier"))},
    {"sharded_epochs": (SHARDED_GLOBAL_BATCH_SPLIT, ("test_sharded_epochs_global_rank", "test_sharded_epochs_order")),
     "train_step": (STEP_NO_ZERO_GRAD, DEVICE_RIGHT),
     "save_checkpoint": (SAVE_EVERY_RANK, FILE_RIGHT)},
    {"sharded_epochs": (SHARDED_ONLY_LOCAL_RANK, ONE_NODE_RIGHT),
     "train_step": (STEP_RANK0_LOSS, STEP_RIGHT),
     "save_checkpoint": (SAVE_POLL_FOR_FILE, WRITER_RIGHT)},
    {"sharded_epochs": (SHARDED_SEED_IGNORED, SHARDS_RIGHT),
     "train_step": (STEP_CPU_TENSOR, LOSS_RIGHT),
     "save_checkpoint": (SAVE_BARRIER_FIRST, WRITER_RIGHT)},
    {"sharded_epochs": (SHARDED_ALONE_UNSEEDED, SHARDS_RIGHT),
     "train_step": (STEP_TENSOR_WHEN_ALONE, STEP_RIGHT),
     "save_checkpoint": (SAVE_OBJECTS, ("test_save_checkpoint_rank0", "test_save_checkpoint_barrier"))},
    {"train_step": (STEP_HARDCODED_CPU, LOSS_RIGHT)},
]

# Right, written differently from the reference: a new sampler per epoch seeded with seed + epoch (the same
# permutation set_epoch gives), ranks from torchrun's environment; an nn.CrossEntropyLoss module, the loss copied into a
# new tensor on the loss's device and averaged with ReduceOp.AVG (gloo supports it); an atomic write through a
# temporary file, the rank from the environment, and the other ranks waiting in a broadcast from rank 0 instead of a
# barrier.
RIGHT = {
    "sharded_epochs": '''
def sharded_epochs(dataset, batch_size, epochs, seed=0):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    for epoch in range(epochs):
        sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True,
                                     seed=seed + epoch, drop_last=False)
        yield epoch, DataLoader(dataset, batch_size=batch_size, sampler=sampler, shuffle=False)
''',
    "train_step": '''
criterion = torch.nn.CrossEntropyLoss()


def train_step(ddp_model, optimizer, images, labels):
    optimizer.zero_grad(set_to_none=True)
    outputs = ddp_model(images)
    loss = criterion(outputs, labels)
    loss.backward()
    optimizer.step()
    mean = torch.tensor([loss.item()], device=loss.device)
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return float(mean[0])
''',
    "save_checkpoint": '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    rank = int(os.environ["RANK"])
    if rank == 0:
        state = {"epoch": epoch, "optimizer": optimizer.state_dict()}
        state["model"] = ddp_model.module.state_dict()
        tmp = str(path) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)        # readers never see half a file
    written = [str(path) if rank == 0 else None]
    torch.distributed.broadcast_object_list(written, src=0)   # every rank hears from rank 0 once it is written
''',
    "concept_ddp_start": 'CONCEPT_DDP_START = "B"',
    "concept_sampler_seed": "CONCEPT_SAMPLER_SEED = ' b '",
}
