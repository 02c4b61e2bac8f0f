"""ZeRO-0 optimizer state without DeepSpeed's own files: checkpoints that do not name their
optimizer's parameters (written before ``optimizer_param_names`` existed), and fp16 runs
(DeepSpeed's ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``), read by name and resharded.

Source: one fp32 ZeRO-0 run at PP 2 (6 steps, saved at 3 and 6). Derived from its step-3
checkpoint, as the files would be had another run written them:

- "positional": the same files without ``optimizer_param_names`` (and without the integrity
  manifest, as checkpoints of that age);
- "fp16-flat" / "fp16-unfused": precision fp16, module weights in fp16, and the optimizer entry of
  each mp_rank file replaced by the ``state_dict()`` of a real DeepSpeed ``FP16_Optimizer`` /
  ``FP16_UnfusedOptimizer`` built over those parameters, whose fp32 masters, Adam moments and step
  are the fp32 run's. fp16 cannot run on the CPU (DeepSpeed's loss scaling needs a GPU), so this
  is how a CPU test gets the files; tests/gpu/test_gpu_reshard.py trains real fp16 runs.

Each must give, parameter by parameter, the same fp32 masters (fp16: the fp32 run's weights) and
Adam moments as the original read through its recorded names: bitwise (the same numbers, located
another way). One of them is resumed at DP 2 under ZeRO-1 and must continue as the fp32 run did
(tolerances of test_reshard.py: other layouts reorder sums, ~1e-7 relative per op).

The other direction -- a checkpoint resumed into an fp16 ZeRO-0 run -- writes into the same two
DeepSpeed optimizers; on the CPU it is checked on the optimizer objects (the state they then hold,
unflattened by torch's own ``_unflatten_dense_tensors``); end to end in tests/gpu.
"""
import glob
import json
import os
import shutil
import types

import pytest
import torch

from tests.checkpoint.common import layout_flags
from tests.checkpoint.test_reshard import FP32, _weights
from tests.distributed import run_distributed
from tests.training.common import TINY_GPT, train_losses
from megatron_ds.families.gpt.gpt_family import GPT

RUN = TINY_GPT + ["--global-batch-size", "8", "--hidden-dropout", "0", "--attention-dropout", "0",
                  "--vocab-size", "500", "--train-iters", "6", "--adam-eps", "1e-4", "--save-interval", "3"]
KINDS = ("positional", "fp16-flat", "fp16-unfused")


def _run(layout, extra):
    tp, pp, dp = layout
    return run_distributed(train_losses, tp * pp * dp, RUN + layout_flags(tp, pp) + list(extra), timeout=600)[-1]


def _load(path):
    return torch.load(path, map_location="cpu", weights_only=False)


def _fp16_optimizer(kind, params_by_group):
    """A real DeepSpeed fp16 optimizer over fp16 copies of the given fp32 tensors."""
    import deepspeed
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer

    deepspeed.init_distributed(dist_backend="gloo")  # the unfused one asks for the rank
    groups = [{"params": [torch.nn.Parameter(t.half()) for t in g]} for g in params_by_group]
    inner = torch.optim.AdamW(groups, lr=1e-3)
    return (FP16_Optimizer if kind == "fp16-flat" else FP16_UnfusedOptimizer)(inner, dynamic_loss_scale=True)


def _fp16_state(kind, opt_sd, names, weights):
    """The fp16 optimizer's state_dict with the fp32 run's masters, moments and step put in."""
    fp32 = [[weights[n] for n in g] for g in names]
    sd = _fp16_optimizer(kind, fp32).state_dict()
    positions = [opt_sd["param_groups"][g]["params"] for g in range(len(names))]
    moments = [[opt_sd["state"][i] for i in group] for group in positions]
    torch_sd = sd["optimizer_state_dict"]
    if kind == "fp16-flat":
        sd["fp32_groups_flat"] = [torch.cat([t.reshape(-1) for t in g]) for g in fp32]
        for g, index in enumerate(p for grp in torch_sd["param_groups"] for p in grp["params"]):
            torch_sd["state"][index] = {"step": moments[g][0]["step"].clone(),
                                        **{k: torch.cat([m[k].reshape(-1) for m in moments[g]])
                                           for k in ("exp_avg", "exp_avg_sq")}}
    else:
        sd["fp32_groups"] = fp32
        order = [p for grp in torch_sd["param_groups"] for p in grp["params"]]
        for index, m in zip(order, [m for g in moments for m in g]):
            torch_sd["state"][index] = {k: v.clone() for k, v in m.items()}
    return sd


def _convert(rank, world_size, src, dst, kind):
    """Write ``dst``: the step-3 checkpoint ``src`` as ``kind`` would have written it."""
    shutil.copytree(src, dst)
    step = os.path.join(dst, "global_step3")
    # as written before manifests existed: no manifest, and no "completeness" entry in the meta file
    # (with the entry, a meta file without its manifest is an interrupted save)
    os.remove(os.path.join(step, "megatron_ds_manifest.json"))
    weights = _weights_by_name(dst)  # fp32: the fp16 runs' masters
    with open(os.path.join(step, "megatron_ds_config.json")) as f:
        meta = json.load(f)
    meta.pop("completeness", None)
    if kind != "positional":
        for path in sorted(glob.glob(os.path.join(step, "layer_*-model_*-model_states.pt"))):
            torch.save({k: v.half() for k, v in _load(path).items()}, path)
        meta["signature"]["precision"] = "fp16"
    with open(os.path.join(step, "megatron_ds_config.json"), "w") as f:
        json.dump(meta, f)
    for path in sorted(glob.glob(os.path.join(step, "mp_rank_*_model_states.pt"))):
        state = _load(path)
        names = state.pop("optimizer_param_names")
        if kind != "positional":
            state["optimizer"] = _fp16_state(kind, state["optimizer"], names, weights)
            state["optimizer_param_names"] = names
        torch.save(state, path)


def _weights_by_name(path):
    """{name: weight} of a TP 1 checkpoint's layer files."""
    from megatron_ds.checkpoint.files import layer_prefixes, open_checkpoint

    ckpt = open_checkpoint(path, 3, GPT)
    return {prefix + k: v.float() for idx, prefix in layer_prefixes(ckpt.model, ckpt.padded_vocab_size, GPT)
            for k, v in _load(ckpt.layer_file(idx, 0)).items()}


@pytest.fixture(scope="module")
def fp32_pp2(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("fp32_pp2"))
    losses = _run((1, 2, 1), ["--save", ckpt])
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("3")
    return losses, ckpt


def _convert_all(rank, world_size, src, dsts):
    for kind, dst in dsts.items():
        _convert(rank, world_size, src, dst, kind)


@pytest.fixture(scope="module")
def derived(fp32_pp2, tmp_path_factory):
    """kind -> the derived step-3 checkpoint (one process writes them all: DeepSpeed imports once)."""
    dsts = {kind: str(tmp_path_factory.mktemp(kind) / "ckpt") for kind in KINDS}
    run_distributed(_convert_all, 1, fp32_pp2[1], dsts)
    return dsts


def _saved(path):
    from megatron_ds.checkpoint.files import open_checkpoint
    from megatron_ds.checkpoint.optim_state import SavedOptimizer
    from megatron_ds.checkpoint.plain_optim import saved_shapes

    ckpt = open_checkpoint(path, 3, GPT)
    saved = SavedOptimizer(ckpt)
    shapes = saved_shapes(ckpt, 0)
    return {name: saved.tensors(name, 0, shape) for name, shape in shapes.items()}, saved.step


@pytest.mark.parametrize("kind", KINDS)
def test_zero0_optimizer_state_is_read_by_name(fp32_pp2, derived, kind):
    _, ckpt = fp32_pp2
    (want, want_step), (got, got_step) = _saved(ckpt), _saved(derived[kind])
    weights = _weights(ckpt, 3)
    assert want_step == got_step == 3
    assert sorted(want) == sorted(got)
    for name, tensors in want.items():
        for key, tensor in tensors.items():
            assert torch.equal(got[name][key], tensor), (name, key)
        if kind != "positional":  # the masters: the fp32 run's weights
            assert torch.equal(got[name]["fp32"], weights[name]), name


def test_fp16_flat_resumes_at_dp2_zero1(fp32_pp2, derived, tmp_path):
    straight, _ = fp32_pp2
    ckpt = derived["fp16-flat"]
    out = str(tmp_path / "resumed")
    resumed = _run((1, 1, 2), ["--zero-stage", "1", "--load", ckpt, "--save", out])
    assert [it for it, _ in resumed] == [4, 5, 6]
    assert [loss for _, loss in resumed] == pytest.approx([loss for _, loss in straight[3:]], **FP32["loss"])
    want, got = _weights(fp32_pp2[1], 6), _weights(out)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, **FP32["weights"], msg=lambda m, name=name: f"{name}: {m}")


def _write_into_fp16(rank, world_size):
    for kind in KINDS[1:]:
        _write_into(kind)


def _write_into(kind):
    from torch._utils import _unflatten_dense_tensors

    from megatron_ds.checkpoint import engine_state

    gen = torch.Generator().manual_seed(0)
    shapes = [[(3, 4), (2, 3)], [(3,), (2,)]]
    opt = _fp16_optimizer(kind, [[torch.randn(s, generator=gen) for s in g] for g in shapes])
    engine = types.SimpleNamespace(optimizer=opt)
    want = {}
    for g, group in enumerate(opt.fp16_groups):
        for p in group:
            values = [torch.randn(p.shape, generator=gen) for _ in range(3)]
            want[g, p.shape] = values
            engine_state.set_optimizer_state(engine, p, values[0], dict(exp_avg=values[1], exp_avg_sq=values[2]))
    engine_state.set_optimizer_step(engine, 7)
    for g, group in enumerate(opt.fp16_groups):
        if kind == "fp16-flat":
            flat = opt.fp32_groups_flat[g]
            state = opt.optimizer.state[flat]
            tensors = [_unflatten_dense_tensors(t, group) for t in (flat, state["exp_avg"], state["exp_avg_sq"])]
            steps = [state["step"]]
        else:
            states = [opt.optimizer.state[t] for t in opt.fp32_groups[g]]
            tensors = [opt.fp32_groups[g], [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states]]
            steps = [s["step"] for s in states]
        for j, p in enumerate(group):
            for k in range(3):
                assert torch.equal(tensors[k][j], want[g, p.shape][k]), (g, j, k)
        assert all(float(s) == 7 for s in steps)
    # the dynamic loss scaler's state (what a saved fp16 optimizer's state_dict() carries)
    scaler = {"dynamic_loss_scale": True, "cur_scale": 4096.0, "cur_iter": 9, "last_overflow_iter": 4}
    assert engine_state.set_loss_scale(engine, scaler)
    assert opt.state_dict()["cur_scale"] == 4096.0 and opt.state_dict()["cur_iter"] == 9
    assert opt.state_dict()["last_overflow_iter"] == 4


def test_state_goes_into_deepspeeds_fp16_optimizers():
    run_distributed(_write_into_fp16, 1)
