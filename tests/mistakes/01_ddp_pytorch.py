"""Realistic mistakes in module 01 (grade_id -> what a student might write), and right answers written
differently from the reference.

tests/test_grading.py grades a submission made of the reference answers with these replacing some of them:
every exercise named in a WRONG / MORE_WRONG student must lose the points of its test cells; RIGHT must keep
full marks. The hidden tests run on 4 gloo ranks simulated as 2 nodes x 2 (LOCAL_RANK = rank % 2).
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

WRONG = {
    "sharded_epochs": SHARDED_NO_SET_EPOCH,
    "train_step": STEP_LOCAL_LOSS,
    "save_checkpoint": SAVE_LOCAL_RANK_0,
}

MORE_WRONG = [
    {"sharded_epochs": SHARDED_LOCAL_RANK, "train_step": STEP_UNWRAPPED, "save_checkpoint": SAVE_NO_BARRIER},
    {"sharded_epochs": SHARDED_NO_SAMPLER, "train_step": STEP_SUM_NOT_MEAN,
     "save_checkpoint": SAVE_BARRIER_ON_RANK0_ONLY},
    {"sharded_epochs": SHARDED_SET_EPOCH_TOO_LATE, "train_step": STEP_SCALED_LOSS,
     "save_checkpoint": SAVE_WRAPPED_KEYS},
    {"sharded_epochs": SHARDED_GLOBAL_BATCH_SPLIT, "train_step": STEP_NO_ZERO_GRAD,
     "save_checkpoint": SAVE_EVERY_RANK},
    {"sharded_epochs": SHARDED_ONLY_LOCAL_RANK, "train_step": STEP_RANK0_LOSS},
    {"sharded_epochs": SHARDED_SEED_IGNORED},
]

# Right, written differently from the reference: a new sampler per epoch seeded with seed + epoch (the same
# permutation set_epoch gives), ranks from torchrun's environment, ReduceOp.AVG (gloo supports it), an
# nn.CrossEntropyLoss module, an atomic write through a temporary file, the rank from the environment.
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
    mean = torch.tensor([loss.item()])
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    return float(mean[0])
''',
    "save_checkpoint": '''
def save_checkpoint(ddp_model, optimizer, epoch, path):
    if int(os.environ["RANK"]) == 0:
        state = {"epoch": epoch, "optimizer": optimizer.state_dict()}
        state["model"] = ddp_model.module.state_dict()
        tmp = str(path) + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, path)        # readers never see half a file
    torch.distributed.barrier()
''',
    "concept_backend": 'CONCEPT_BACKEND = "C"',
    "concept_sampler_seed": "CONCEPT_SAMPLER_SEED = ' a '",
}
