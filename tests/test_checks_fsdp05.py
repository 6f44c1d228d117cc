"""Module 05's checks outside the kernel (autograder/checks/fsdp05.py) on data made here: what a right run hands in
passes, and each demand fails the data of its mistake, with a message that says what was expected. Cheap: no
process group, no notebook (tests/test_grading.py grades the real submissions)."""
import copy

import pytest
import torch

from autograder.checks import fsdp05 as g
from coursekit.evidence import plain
from coursekit.exercise_checks import fsdp as checks

UNIT = {"param_dtype": None, "reshard_after_forward": True}
NAMES = list(checks.build_vit(checks.TINY).state_dict())


def _facts(bf16=False):
    unit = checks.BF16_UNIT if bf16 else UNIT
    facts = {"root": unit, "blocks": [unit, unit], "placements": {n: checks.SHARDED for n in NAMES},
             "optimizer_holds_model_params": True, "lr": 0.01, "sharded_dtypes": ["torch.float32"],
             "optimizer_state": ["DTensor"], "default_meshes": 0}
    if bf16:
        facts["logits_dtype"] = "torch.bfloat16"
    return facts


def _setup(**changes):
    ranks = [{"facts": _facts(), "bf16_facts": _facts(bf16=True)} for _ in range(4)]
    for path, value in changes.items():
        rank, kind, key = path.split("__")
        ranks[int(rank)][kind][key] = value
    return {"setup": {"value": ranks, "error": None}, "source": "def f(c, device):\n    init_device_mesh(device.type, (4,))\n"}


def test_setup_checks_pass_a_right_run_and_fail_each_mistake():
    assert g.setup_fsdp(_setup()) and g.setup_fsdp_options(_setup())
    with pytest.raises(AssertionError, match="the literal"):
        g.setup_fsdp({**_setup(), "source": "def f(c, d):\n    init_device_mesh('cuda', (4,))\n"})
    with pytest.raises(AssertionError, match="rank 3: create the optimizer AFTER"):
        g.setup_fsdp(_setup(**{"3__facts__optimizer_holds_model_params": False}))
    with pytest.raises(AssertionError, match="lr=config"):
        g.setup_fsdp(_setup(**{"2__facts__lr": 0.001}))
    with pytest.raises(AssertionError, match="each block"):
        g.setup_fsdp(_setup(**{"0__facts__blocks": [None, None]}))
    with pytest.raises(AssertionError, match=r"rank 3: 2 fully_shard call\(s\) were given no mesh"):
        g.setup_fsdp(_setup(**{"3__facts__default_meshes": 2}))     # fully_shard(block) without mesh=
    with pytest.raises(AssertionError, match="rank 1: with no options the blocks keep"):
        g.setup_fsdp_options(_setup(**{"1__facts__blocks": [checks.BF16_UNIT] * 2}))
    with pytest.raises(AssertionError, match="must stay float32"):
        g.setup_fsdp_options(_setup(**{"2__bf16_facts__sharded_dtypes": ["torch.bfloat16"]}))
    with pytest.raises(AssertionError, match="setup_fsdp on 4 ranks"):
        g.setup_fsdp({"setup": {"value": None, "error": "RuntimeError: boom"}})
    assert not checks.mesh_type_literals("def f(d):\n    init_device_mesh(device_type=d.type, mesh_shape=(2,))\n")


def test_training_compares_every_rank_with_one_process_and_skips_only_the_key_bias():
    runs = []
    for case in [g.VISIBLE_TRAINING, *g.ASKED["test_setup_fsdp_training"]]:
        reference = g.trained_reference(case[0], case[1])
        noisy = {k: v.clone() for k, v in reference.items()}
        width = checks.TINY["width"]
        noisy["blocks.0.attn.qkv.bias"][width:2 * width] += 1e-2      # Adam's noise on the key bias: not compared
        runs.append({"case": case, "value": plain([noisy] * case[2]), "error": None})
    assert g.setup_fsdp_training({"runs": runs})
    wrong = copy.deepcopy(runs)
    bad = g.trained_reference(0, 0.01)["head.weight"] + 3e-5
    wrong[0]["value"][3]["head.weight"] = plain(bad)
    with pytest.raises(AssertionError, match=r"rank 3: after 3 steps .* tolerance 1e-05"):
        g.setup_fsdp_training({"runs": wrong})
    with pytest.raises(AssertionError, match="handed in no run"):
        g.setup_fsdp_training({"runs": runs[:1]})


def _chunked(rows_by_rank):
    return {"size": [sum(rows_by_rank), 4], "chunks": [
        {"offsets": [sum(rows_by_rank[:r]), 0], "sizes": [n, 4], "file": f"__{r}_0.distcp"}
        for r, n in enumerate(rows_by_rank) if n]}


def test_sharded_metadata_passes_shards_and_fails_whole_tensors():
    sharded = {"names": ["model.a", "model.b"], "tensors": {"model.a": _chunked([3, 3, 3, 1]),
                                                           "model.b": _chunked([8, 8, 8, 8])}}
    assert g.save_and_report_sharded({"metadata": {"value": sharded, "error": None}})
    whole = {"names": ["model.a", "model.b"], "tensors": {"model.a": _chunked([10, 0, 0, 0]),
                                                         "model.b": _chunked([0, 8, 0, 0])}}
    with pytest.raises(AssertionError, match="not sharded: 2 of 2 tensors were saved whole"):
        g.save_and_report_sharded({"metadata": {"value": whole, "error": None}})
    with pytest.raises(AssertionError, match="no readable DCP metadata"):
        g.save_and_report_sharded({"metadata": {"value": None, "error": "FileNotFoundError: .metadata"}})


def test_save_checks_compare_the_merged_checkpoint_with_the_state_of_one_step():
    params, buffers = g.stepped_reference()
    reports = [[{"metrics": {"epoch": 4, "loss": 0.5}, "files": sorted([f"__{r}_0.distcp"] + ([".metadata"] if r == 0 else []))}]
               for r in range(4)]
    data = {"reports": {"value": reports, "error": None}, "saved": plain({"value": {"params": params, "buffers": buffers}}),
            "merged": plain({"value": {"params": params, "buffers": buffers, "epoch": 4}, "error": None})}
    assert g.save_and_report(data)
    only_rank0 = copy.deepcopy(data)
    for r in range(1, 4):
        only_rank0["reports"]["value"][r][0]["files"] = None
    with pytest.raises(AssertionError, match="rank 1 must report a checkpoint"):
        g.save_and_report(only_rank0)
    no_optimizer = copy.deepcopy(data)
    no_optimizer["merged"]["value"]["buffers"] = {}
    with pytest.raises(AssertionError, match="optimizer state too"):
        g.save_and_report(no_optimizer)
    made_up = copy.deepcopy(data)                    # the same made-up state handed in as saved and as loaded
    fake = {k: torch.zeros_like(v) for k, v in params.items()}
    made_up["saved"]["value"]["params"] = plain(fake)
    made_up["merged"]["value"]["params"] = plain(fake)
    with pytest.raises(AssertionError, match="not those of one SGD step"):
        g.save_and_report(made_up)


def test_export_checks_read_the_file_as_described_and_compare_with_the_seeded_weights():
    hidden = g.ASKED["test_export_full_state_dict"][0]
    model_bytes = g.vit_bytes(hidden[3])

    def run(seed, files=None, state=None, width=32, peaks=None):
        state = checks.build_vit({**checks.TINY, "width": width, "seed": seed}).state_dict() if state is None else state
        return {"value": plain({"names": files or [["model_full.pt"]] + [[]] * 3, "file": {
            "exists": True, "error": None, "kinds": {k: "Tensor torch.float32 cpu" for k in state}, "state": state},
            "peaks": peaks or [2 * model_bytes, 0.5 * model_bytes]}), "error": None}
    data = {"runs": [{"case": g.VISIBLE_EXPORT, **run(3)},
                     {"case": hidden, **run(8, [["model_full.pt"], []], width=hidden[3])}]}
    assert g.export_full_state_dict(data) and g.export_full_state_dict_weights(data)
    wrong_seed = {"runs": [data["runs"][0], {"case": hidden, **run(3, [["model_full.pt"], []], width=hidden[3])}]}
    with pytest.raises(AssertionError, match="seed 8 on 2 ranks .*full weights"):
        g.export_full_state_dict_weights(wrong_seed)
    # cpu_offload left out: every rank gathers the full model and keeps it (rank 1's tensors rose by more than the model)
    every_rank_holds = {"runs": [data["runs"][0], {"case": hidden, **run(8, [["model_full.pt"], []], width=hidden[3],
                                                                            peaks=[2 * model_bytes, 1.1 * model_bytes])}]}
    with pytest.raises(AssertionError, match=r"rank 1's tensors rose by .* \(1.10 x the model\).*only rank 0 may hold"):
        g.export_full_state_dict_weights(every_rank_holds)
    every_rank = {"runs": [{"case": g.VISIBLE_EXPORT, **run(3, [["model_full.pt"]] * 4)}, data["runs"][1]]}
    with pytest.raises(AssertionError, match="only global rank 0 saves: rank 1"):
        g.export_full_state_dict(every_rank)
    dtensors = copy.deepcopy(data)
    described = dtensors["runs"][0]["value"]["file"]
    described["kinds"] = {k: "DTensor torch.float32 cpu" for k in described["kinds"]}
    described["state"] = {k: None for k in described["state"]}
    with pytest.raises(AssertionError, match="must load into a plain ViT"):
        g.export_full_state_dict(dtensors)
    with pytest.raises(AssertionError, match="plain fp32 CPU tensors"):
        g.export_full_state_dict_weights(dtensors)


def test_meta_memory_and_hybrid_traffic():
    fresh = {"devices": ["cpu"], "not_sharded": [], "units": [True] * 7, "not_finite": [], "cls_token": 0.0,
             "pos_embed_std": 0.02, "pos_embed_mean": -0.0003, "layernorm": [1.0], "linear_over_bound": []}
    reference = g.fresh_reference()     # each rank's shards from seeds 0 and 1, by digest (pos_embed: any draw)

    def probe(rank):
        seed0, seed1 = ({**shards, "pos_embed": f"pos{i}"} for i, shards in enumerate(reference[rank]))
        return {"shards": [seed0, dict(seed0), seed1], "bf16_units": [checks.BF16_UNIT] * 3, "default_meshes": 0,
                "allocated_before_sharding": 0,
                "gpu_worker": {"on the device": {"to_empty": [f"cuda:{rank % 2}"], "error": None},
                               "offloaded": {"to_empty": ["cpu"], "error": None}}}
    mid = g.mid_bytes()
    meta = {"meta": {"value": {"error": None, "ranks": [
        {"fresh": fresh, "fresh_peak": 0.6 * mid, "load_peak": 1.2 * mid, "probe": probe(0)},
        {"fresh": {**fresh, "cls_token": None}, "fresh_peak": 0.6 * mid, "load_peak": 0.6 * mid, "probe": probe(1)}]},
        "error": None}}
    assert g.build_on_meta(meta) and g.build_on_meta_memory(meta)

    def changed(part, **facts):
        wrong = copy.deepcopy(meta)
        wrong["meta"]["value"]["ranks"][1][part].update(facts)
        return wrong
    for part, facts, check, message in [
            ("fresh", {"pos_embed_mean": 1.0}, g.build_on_meta, "pos_embed must be drawn from a normal with mean 0 .* rank 1.s shard has mean 1.0000"),
            # never seeded: another model on every build
            ("probe", {"shards": [probe(1)["shards"][0], {**probe(1)["shards"][0], "head.weight": "x"},
                                  probe(1)["shards"][2]]}, g.build_on_meta, "from the same config.'seed'., the shards differ"),
            # seeded with a constant
            ("probe", {"shards": [probe(1)["shards"][0]] * 3}, g.build_on_meta,
             r"random parameters are equal: \['blocks.0.attn.proj.bias'"),
            # seeded, but pos_embed drawn before reset_parameters() (or the seed + 1): other values than the reference's
            ("probe", {"shards": [{**shards, "head.weight": "other"} for shards in probe(1)["shards"][:2]]
                       + probe(1)["shards"][2:]}, g.build_on_meta,
             r"rank 1: built fresh from seed 0, these shards are not the values .*\['head.weight'\]"),
            ("probe", {"bf16_units": [checks.BF16_UNIT, checks.BF16_UNIT, checks.DEFAULT_UNIT]}, g.build_on_meta,
             "pass \\*\\*fsdp_kwargs to every fully_shard call"),
            ("probe", {"default_meshes": 2}, g.build_on_meta, "were given no mesh"),
            ("probe", {"gpu_worker": {"on the device": {"to_empty": ["cpu"], "error": None},
                                      "offloaded": {"to_empty": ["cpu"], "error": None}}}, g.build_on_meta,
             "without CPU offload, to_empty allocated the shards on cpu"),
            ("probe", {"allocated_before_sharding": 15370}, g.build_on_meta_memory, "rank 1: fully_shard found 15370 values")]:
        with pytest.raises(AssertionError, match=message):
            check(changed(part, **facts))
    eager = copy.deepcopy(meta)
    eager["meta"]["value"]["ranks"][0]["fresh_peak"] = 1.1 * mid
    with pytest.raises(AssertionError, match="rank 0: its memory rose"):
        g.build_on_meta_memory(eager)
    no_cls = copy.deepcopy(meta)
    no_cls["meta"]["value"]["ranks"][0]["fresh"]["cls_token"] = 0.3
    with pytest.raises(AssertionError, match="cls_token must be zeros"):
        g.build_on_meta(no_cls)
    assert g._traffic([["all_gather_single", [0, 1], 8], ["all_reduce", [1, 3], 4], ["all_gather_single", [0, 1], 8]], 2) == {
        ("all_gather_single", "inside a node"): [2, 16], ("all_reduce", "across nodes"): [1, 4]}


def test_restore_checks_compare_state_lr_and_what_each_rank_loaded_whole():
    params, buffers = g.stepped_reference()

    def runs(part, lr=g.SAVED_LR, loaded_whole=(), epoch_offset=1):
        state = params if part == 0 else buffers
        return {"runs": [{"case": case, "error": None, "value": plain({
            "saved": state, "restored": [{"epoch": case[2] + epoch_offset, "state": state, "lr": [lr],
                                          "loaded_whole": list(loaded_whole)}] * case[1]})}
            for case in [g.VISIBLE_RESTORE, *g.ASKED["test_restore_checkpoint"]]]}
    assert g.restore_checkpoint(runs(0)) and g.restore_checkpoint_optimizer(runs(1))
    with pytest.raises(AssertionError, match=r"the saved epoch \(2\) \+ 1, not 2"):
        g.restore_checkpoint(runs(0, epoch_offset=0))
    # set_state_dict left out: dcp.load filled the tensors in place, the optimizer kept the new run's lr
    with pytest.raises(AssertionError, match=r"learning rate must be the checkpoint's \(0.0025.*not \[0.01\]"):
        g.restore_checkpoint_optimizer(runs(1, lr=0.01))
    # a restore through full state dicts: every rank reads every rank's shards
    whole = ["model.head.weight", "optimizer.state.head.weight.momentum_buffer"]
    with pytest.raises(AssertionError, match=r"rank 0: dcp.load was asked to fill 1 whole tensors of the model"):
        g.restore_checkpoint(runs(0, loaded_whole=whole))
    with pytest.raises(AssertionError, match=r"1 whole tensors of the optimizer \(\['optimizer.state"):
        g.restore_checkpoint_optimizer(runs(1, loaded_whole=whole))


def test_the_visible_checks_of_the_four_cells_that_only_handed_evidence_in():
    """The checks the notebook now runs in the kernel (issue 38): training like one process, a sharded DCP
    metadata, the restored optimizer state, the exported weights. Each passes the right data and fails its mistake."""
    reference = g.trained_reference(0, 0.01)
    # the kernel's reference is the grader's, up to rounding (and the key bias's Adam noise, left out by both)
    checks.check_trained_like_one_process([plain(checks.one_process_trained(checks.TINY, g.train_batches()))], reference)
    checks.check_trained_like_one_process([plain(reference)] * 4, reference)
    with pytest.raises(AssertionError, match=r"rank 2: after 3 steps"):
        checks.check_trained_like_one_process(
            [plain(reference)] * 2 + [plain({**reference, "head.weight": reference["head.weight"] + 1e-3})], reference)

    sharded = {"names": ["model.a", "model.b"], "tensors": {"model.a": _chunked([3, 3, 3, 1]),
                                                           "model.b": _chunked([8, 8, 8, 8])}}
    checks.check_sharded_metadata(sharded)
    checks.check_sharded_metadata({"names": ["a"], "tensors": {"a": _chunked([2, 2, 1, 0])}})   # rank 3 has no rows
    for rows in ([10, 0, 0, 0], [0, 10, 0, 0], [3, 3, 4, 0]):     # a plain torch.save has no .metadata at all
        with pytest.raises(AssertionError, match="not sharded"):
            checks.check_sharded_metadata({"names": ["a"], "tensors": {"a": _chunked(rows)}})

    params, buffers = g.stepped_reference()
    checks.check_restored_optimizer(plain(buffers), plain(buffers), [g.SAVED_LR], g.SAVED_LR)
    with pytest.raises(AssertionError, match="optimizer state too"):
        checks.check_restored_optimizer(plain({k: v + 1 for k, v in buffers.items()}), plain(buffers), [g.SAVED_LR],
                                        g.SAVED_LR)
    with pytest.raises(AssertionError, match="learning rate must be the checkpoint's"):
        checks.check_restored_optimizer(plain(buffers), plain(buffers), [0.01], g.SAVED_LR)

    weights = checks.build_vit({**checks.TINY, "seed": 3}).state_dict()
    described = plain({"exists": True, "error": None, "kinds": {k: "Tensor torch.float32 cpu" for k in weights},
                       "state": weights})
    checks.check_export_weights(described, weights)
    with pytest.raises(AssertionError, match="plain fp32 CPU tensors"):
        checks.check_export_weights({**described, "kinds": {k: "Tensor torch.bfloat16 cpu" for k in weights}}, weights)
    with pytest.raises(AssertionError, match="full weights"):
        checks.check_export_weights(described, checks.build_vit({**checks.TINY, "seed": 4}).state_dict())
