"""Realistic mistakes in module 03 (grade_id -> what a student might write), and right answers written differently.

A mistake written as (code, cells) keeps the points of the cells that check what it gets right. The graded cells:
    preprocess:          _values (normalisation, shape, dtype), _columns (int64 labels, other columns, inputs intact)
    build_train_dataset: _resources (num_cpus, tasks at once, batch size), _plan (lazy read of the folder + one
                         map_batches), _rows (every row once, preprocessed)
    make_trainer:        one cell (the Dataset's rows under "train", still lazy; Ray Data's CPU limit; the rest as given)
    train_func:          _shard (2 nodes x 2 against one process), _report (losses over all workers), _one_worker (no
                         process group, as local mode), _device (the sums on ray.train.torch.get_device())
"""

# -- the train function: the reference with one line changed per mistake ---------------------------------------

_TRAIN_HEAD = (
    "def train_func(config):\n"
    "    torch.manual_seed(config['seed'])\n"
    "    model = ray.train.torch.prepare_model(build_model(config['model']))\n"
    "    optimizer = (torch.optim.SGD if config['optimizer'] == 'sgd' else torch.optim.Adam)(\n"
    "        model.parameters(), lr=config['lr'])\n"
    "    criterion = torch.nn.CrossEntropyLoss()\n"
    "    ctx = ray.train.get_context()\n"
)
_TRAIN_LOOP = (
    "    for epoch in range(config['epochs']):\n"
    "        total = torch.zeros(2, device=ray.train.torch.get_device())\n"
    "        for batch in shard.iter_torch_batches(batch_size=batch_size):\n"
    "            loss = criterion(model(batch['image']), batch['label'])\n"
    "            optimizer.zero_grad()\n"
    "            loss.backward()\n"
    "            optimizer.step()\n"
    "            total += torch.tensor([loss.item() * len(batch['label']), len(batch['label'])], device=total.device)\n"
    "        if dist.is_available() and dist.is_initialized():\n"
    "            dist.all_reduce(total)\n"
    "        save_checkpoint_and_report(model, {'epoch': epoch, 'loss': (total[0] / total[1]).item()})\n"
)


def _train(batch_size_line: str, shard_line: str = "    shard = ray.train.get_dataset_shard('train')\n",
           loop: str = _TRAIN_LOOP, before: str = "") -> str:
    return before + _TRAIN_HEAD + batch_size_line + shard_line + loop


# The cells a mistake may keep: they check what it gets right.
COLUMNS_RIGHT = ("test_preprocess_columns",)
VALUES_RIGHT = ("test_preprocess_values",)
PLAN_AND_ROWS_RIGHT = ("test_build_train_dataset_plan", "test_build_train_dataset_rows")
ROWS_RIGHT = ("test_build_train_dataset_rows",)
ONE_WORKER_RIGHT = ("test_train_func_one_worker", "test_train_func_device")   # right when the job has one worker
DEVICE_RIGHT = ("test_train_func_device",)
ALL_BUT_ONE_WORKER = ("test_train_func_shard", "test_train_func_report", "test_train_func_device")

def _preprocess(body: str) -> str:
    return "def preprocess(batch):\n" + body


_NORMALISED = "((np.asarray(batch['image'], dtype=np.float32) / 255.0 - 0.5) / 0.5)[:, None, :, :]"

WRONG = {
    # scales the pixels to [0, 1] but forgets the normalisation with mean/std 0.5
    "preprocess": (_preprocess(
        "    out = dict(batch)\n"
        "    out['image'] = (np.asarray(batch['image'], dtype=np.float32) / 255.0)[:, None, :, :]\n"
        "    out['label'] = np.asarray(batch['label'], dtype=np.int64)\n"
        "    return out\n"), COLUMNS_RIGHT),
    # map_batches without the stated resources: every task reserves 1 CPU, as many as the cluster allows
    "build_train_dataset": (
        "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
        "    ds = ray.data.read_parquet(parquet_dir)\n"
        "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size)\n",
        PLAN_AND_ROWS_RIGHT),
    # hands the Dataset to the workers through train_loop_config instead of datasets=
    "make_trainer": (
        "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
        "    return TorchTrainer(train_func, train_loop_config={**train_loop_config, 'train_ds': train_ds},\n"
        "                        scaling_config=scaling_config, run_config=run_config,\n"
        "                        dataset_config=DataConfig(execution_options=ExecutionOptions(\n"
        "                            resource_limits=ExecutionResources(cpu=data_cpus))))\n"),
    # passes the global batch to iter_torch_batches as if it were the per-worker batch (right on one worker)
    "train_func": (_train("    batch_size = config['global_batch_size']\n"), ONE_WORKER_RIGHT),
}

MORE_WRONG = [
    {
        # normalises with MNIST's own mean and std instead of the course's 0.5 / 0.5
        "preprocess": (_preprocess(
            "    out = dict(batch)\n"
            "    x = np.asarray(batch['image'], dtype=np.float32) / 255.0\n"
            "    out['image'] = ((x - 0.1307) / 0.3081)[:, None, :, :].astype(np.float32)\n"
            "    out['label'] = np.asarray(batch['label']).astype(np.int64)\n"
            "    return out\n"), COLUMNS_RIGHT),
        # takes the resources from the notebook's plan instead of the arguments
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size,\n"
            "                          num_cpus=plan.map_num_cpus,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=plan.map_concurrency))\n",
            PLAN_AND_ROWS_RIGHT),
        # names the dataset after the variable: the workers' get_dataset_shard('train') finds nothing
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    limits = ExecutionOptions(resource_limits=ExecutionResources(cpu=data_cpus))\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train_ds': train_ds},\n"
            "                        dataset_config=DataConfig(execution_options=limits))\n"),
        # divides the global batch by the workers of ONE node (local world size), not of the whole job
        "train_func": (_train("    batch_size = config['global_batch_size'] // ctx.get_local_world_size()\n"),
                       ONE_WORKER_RIGHT),
    },
    {
        # keeps the 28x28 shape: no channel dimension for the CNN
        "preprocess": (_preprocess(
            "    out = dict(batch)\n"
            "    out['image'] = ((np.asarray(batch['image'], dtype=np.float32) / 255.0 - 0.5) / 0.5)\n"
            "    out['label'] = np.asarray(batch['label']).astype(np.int64)\n"
            "    return out\n"), COLUMNS_RIGHT),
        # materializes the data set: the whole data set is read and held before training starts
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir)\n"
            "    ds = ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "                        compute=ray.data.TaskPoolStrategy(size=concurrency))\n"
            "    return ds.materialize()\n",
            ROWS_RIGHT),
        # forgets the data config: Ray Data is not limited to the CPUs left by the training workers
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train': train_ds})\n"),
        # every worker reads the WHOLE preprocessed data set (a global Dataset) instead of its shard
        "train_func": _train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            shard_line="    shard = full_train_ds\n",
            before="full_train_ds = ray.data.read_parquet(parquet_dir).map_batches(preprocess, batch_format='numpy')\n\n\n"),
    },
    {
        # returns only what the model needs: the row ids (and any other column) are dropped
        "preprocess": (_preprocess(
            f"    return {{'image': {_NORMALISED},\n"
            "            'label': np.asarray(batch['label'], dtype=np.int64)}\n"), VALUES_RIGHT),
        # the CPUs stated on the read instead of on the preprocessing step
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir, num_cpus=num_cpus)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=concurrency))\n",
            PLAN_AND_ROWS_RIGHT),
        # the notebook's own plan instead of data_cpus: right here, wrong for any other cluster
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train': train_ds},\n"
            "                        dataset_config=DataConfig(execution_options=ExecutionOptions(\n"
            "                            resource_limits=ExecutionResources(cpu=plan.data_cpus))))\n"),
        # the loss of this worker only (no all_reduce): each rank reports a different number
        # (the data and the model are right, and one worker has nothing to sum: it keeps those cells)
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("        if dist.is_available() and dist.is_initialized():\n"
                                     "            dist.all_reduce(total)\n", "")),
            ("test_train_func_shard",) + ONE_WORKER_RIGHT),
    },
    {
        # preprocesses the (already preprocessed) batches again on the training workers
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("model(batch['image'])", "model((batch['image'] - 0.5) / 0.5)")), DEVICE_RIGHT),
        # preprocess applied twice (once in a read-time map, once more in map_batches)
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    ds = ray.data.read_parquet(parquet_dir).map_batches(preprocess)\n"
            "    return ds.map_batches(preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "                          compute=ray.data.TaskPoolStrategy(size=concurrency))\n"),
        # materializes the Dataset it hands over: every row held in the object store before training starts
        "make_trainer": (
            "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
            "    limits = ExecutionOptions(resource_limits=ExecutionResources(cpu=data_cpus))\n"
            "    return TorchTrainer(train_func, train_loop_config=train_loop_config, scaling_config=scaling_config,\n"
            "                        run_config=run_config, datasets={'train': train_ds.materialize()},\n"
            "                        dataset_config=DataConfig(execution_options=limits))\n"),
    },
    {
        # reads only the first Parquet file of the folder (one file in the notebook's small runs, several in real ones)
        "build_train_dataset": (
            "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
            "    first = sorted(Path(parquet_dir).glob('*.parquet'))[0]\n"
            "    return ray.data.read_parquet(str(first)).map_batches(\n"
            "        preprocess, batch_format='numpy', batch_size=batch_size, num_cpus=num_cpus,\n"
            "        compute=ray.data.TaskPoolStrategy(size=concurrency))\n",
            ("test_build_train_dataset_resources",) + ROWS_RIGHT),
        # drops the last, smaller batch of every epoch
        # (the losses it reports are right for the batches it used: it keeps the report, one-worker and device cells)
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("iter_torch_batches(batch_size=batch_size)",
                                     "iter_torch_batches(batch_size=batch_size, drop_last=True)")),
            ("test_train_func_report",) + ONE_WORKER_RIGHT),
        # keeps the labels' dtype (int32 in some files): the loss wants int64 class indices
        "preprocess": (_preprocess(
            "    out = dict(batch)\n"
            f"    out['image'] = {_NORMALISED}\n"
            "    return out\n"), VALUES_RIGHT),
    },
    {
        # the sums on the default device (the CPU): on GPU workers NCCL's all-reduce refuses them
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("torch.zeros(2, device=ray.train.torch.get_device())", "torch.zeros(2)")
                            .replace(", device=total.device)", ")")),
            ("test_train_func_shard", "test_train_func_report", "test_train_func_one_worker")),
    },
    {
        # all-reduces without asking whether a process group exists: fails on one worker in local mode
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("        if dist.is_available() and dist.is_initialized():\n"
                                     "            dist.all_reduce(total)\n", "        dist.all_reduce(total)\n")),
            ALL_BUT_ONE_WORKER),
    },
    {
        # reports the unwrapped model as model.module: prepare_model wraps in DDP only when there are 2+ workers
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace("save_checkpoint_and_report(model,", "save_checkpoint_and_report(model.module,")),
            ALL_BUT_ONE_WORKER),
    },
    {
        # each epoch's report with the last batch's accuracy: accuracy() puts the model in eval mode and nothing puts
        # it back, so every epoch after the first trains in eval mode (BatchNorm uses, and never updates, its
        # running statistics)
        "train_func": (_train(
            "    batch_size = config['global_batch_size'] // ctx.get_world_size()\n",
            loop=_TRAIN_LOOP.replace(
                "        save_checkpoint_and_report(model, {'epoch': epoch, 'loss': (total[0] / total[1]).item()})\n",
                "        acc = accuracy(getattr(model, 'module', model), batch['image'], batch['label'])\n"
                "        save_checkpoint_and_report(model, {'epoch': epoch, 'loss': (total[0] / total[1]).item(),\n"
                "                                           'batch_accuracy': acc})\n")),
            ALL_BUT_ONE_WORKER),
    },
]

RIGHT = {
    # the idiomatic Ray Data style: replace the batch's entries and return it; x / 127.5 - 1 == (x / 255 - 0.5) / 0.5
    "preprocess": (
        "def preprocess(batch):\n"
        "    batch['image'] = (batch['image'][:, np.newaxis, :, :].astype(np.float32) / 127.5 - 1.0).astype('float32')\n"
        "    batch['label'] = batch['label'].astype('int64')\n"
        "    return batch\n"),
    # a list of files, the older `concurrency=` spelling, a wrapper function and the default batch format
    "build_train_dataset": (
        "import glob\n\n"
        "def build_train_dataset(parquet_dir, num_cpus, concurrency, batch_size):\n"
        "    files = sorted(glob.glob(os.path.join(parquet_dir, '*.parquet')))\n"
        "    def prep(batch):\n"
        "        return preprocess(batch)\n"
        "    return ray.data.read_parquet(files).map_batches(\n"
        "        prep, batch_size=batch_size, concurrency=concurrency, num_cpus=num_cpus)\n"),
    # keyword arguments in another order, a per-dataset execution options dict, ExecutionResources.for_limits, and
    # the Dataset reshuffled (the notebook suggests it): the same rows, still lazy
    "make_trainer": (
        "def make_trainer(train_func, train_ds, train_loop_config, scaling_config, run_config, data_cpus):\n"
        "    options = ExecutionOptions(resource_limits=ExecutionResources.for_limits(cpu=data_cpus))\n"
        "    cfg = ray.train.DataConfig(datasets_to_split='all', execution_options={'train': options})\n"
        "    return ray.train.torch.TorchTrainer(\n"
        "        train_loop_per_worker=train_func, datasets=dict(train=train_ds.random_shuffle()), dataset_config=cfg,\n"
        "        run_config=run_config, scaling_config=scaling_config, train_loop_config=train_loop_config)\n"),
    # the shard fetched every epoch, dtypes and device stated, the world size from torch.distributed
    "train_func": (
        "def train_func(config):\n"
        "    torch.manual_seed(config['seed'])\n"
        "    net = build_model(config['model'])\n"
        "    net = ray.train.torch.prepare_model(net)\n"
        "    opt = {'sgd': torch.optim.SGD, 'adam': torch.optim.Adam}[config['optimizer']](net.parameters(), lr=config['lr'])\n"
        "    loss_fn = torch.nn.CrossEntropyLoss()\n"
        "    world = dist.get_world_size() if dist.is_initialized() else 1\n"
        "    device = ray.train.torch.get_device()\n"
        "    for epoch in range(config['epochs']):\n"
        "        net.train()\n"
        "        loss_sum, seen = 0.0, 0\n"
        "        shard = ray.train.get_dataset_shard('train')\n"
        "        batches = shard.iter_torch_batches(batch_size=config['global_batch_size'] // world,\n"
        "                                           dtypes={'image': torch.float32, 'label': torch.int64, 'id': torch.int64},\n"
        "                                           device=device)\n"
        "        for batch in batches:\n"
        "            x, y = batch['image'], batch['label']\n"
        "            out = net(x)\n"
        "            loss = loss_fn(out, y)\n"
        "            opt.zero_grad()\n"
        "            loss.backward()\n"
        "            opt.step()\n"
        "            loss_sum += float(loss) * y.shape[0]\n"
        "            seen += y.shape[0]\n"
        "        stats = torch.tensor([loss_sum, float(seen)], dtype=torch.float64, device=device)\n"
        "        if dist.is_initialized():\n"
        "            dist.all_reduce(stats, op=dist.ReduceOp.SUM)\n"
        "        save_checkpoint_and_report(net, {'epoch': epoch, 'loss': float(stats[0] / stats[1])})\n"),
}
