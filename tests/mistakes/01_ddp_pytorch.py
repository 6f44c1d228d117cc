"""Realistic mistakes in module 01 (grade_id -> what a student might write).

tests/test_grading.py grades a submission made of the reference answers with
these replacing some of them; it must get partial credit.
"""
WRONG = {
    # forgets set_epoch: every epoch repeats the same order
    "rank_indices": (
        "def rank_indices(dataset_len, rank, world_size, epoch, seed=0):\n"
        "    sampler = DistributedSampler(range(dataset_len), num_replicas=world_size, rank=rank,\n"
        "                                 shuffle=True, seed=seed)\n"
        "    return [int(i) for i in sampler]\n"),
    # sums the loss instead of averaging it: steps no longer equal the full-batch step
    "ddp_train_step": (
        "def ddp_train_step(rank, world_size, state_dict, images, labels, lr):\n"
        "    model = build_small_cnn()\n"
        "    model.load_state_dict(state_dict)\n"
        "    ddp_model = DDP(model)\n"
        "    shard = len(labels) // world_size\n"
        "    x, y = images[rank * shard:(rank + 1) * shard], labels[rank * shard:(rank + 1) * shard]\n"
        "    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=lr)\n"
        "    optimizer.zero_grad()\n"
        "    F.cross_entropy(ddp_model(x), y, reduction='sum').backward()\n"
        "    optimizer.step()\n"
        "    return {k: v.detach().clone() for k, v in ddp_model.module.state_dict().items()}, len(y)\n"),
}
