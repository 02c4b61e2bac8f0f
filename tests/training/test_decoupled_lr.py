"""--decoupled-lr / --decoupled-min-lr (Megatron-LM): the word embedding and output layer weights follow
the same schedule between their own peak and floor. Compared with a transcription of Megatron-LM's
OptimizerParamScheduler.get_lr(param_group) (megatron/core/optimizer_param_scheduler.py, core_v0.19.0:
a group's ``max_lr`` / ``min_lr`` replace the scheduler's; steps counted in samples) and with torch's
AdamW stepping a plain copy of the model whose groups are picked by parameter name."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
from tests.distributed import run_distributed
from tests.training.engine_worker import BASE, VOCAB, engine_for, micro_batch

LR, MIN_LR, DEC_LR, DEC_MIN_LR = 1e-3, 1e-4, 5e-3, 5e-4
WARMUP, ITERS, GB, STEPS = 2, 6, 2, 5
SCHEDULE = (f"--lr {LR} --min-lr {MIN_LR} --decoupled-lr {DEC_LR} --decoupled-min-lr {DEC_MIN_LR} "
            f"--lr-decay-style cosine --lr-warmup-iters {WARMUP} --train-iters {ITERS} --micro-batch-size {GB} "
            f"--global-batch-size {GB} --weight-decay 0.1 --clip-grad 0 --adam-beta2 0.95").split()
EMBEDDING_OR_OUTPUT = ("word_embeddings.weight", "output_layer.weight")  # Megatron-LM's two, by name


def megatron_lr(num_steps: int, max_lr: float, min_lr: float) -> float:
    """OptimizerParamScheduler.get_lr transcribed (init_lr 0, cosine); spans in samples."""
    warmup_steps, decay_steps = WARMUP * GB, ITERS * GB
    if warmup_steps > 0 and num_steps <= warmup_steps:
        return max_lr * float(num_steps) / float(warmup_steps)
    if num_steps > decay_steps:
        return min_lr
    decay_ratio = float(num_steps - warmup_steps) / float(decay_steps - warmup_steps)
    return min_lr + 0.5 * (math.cos(math.pi * decay_ratio) + 1.0) * (max_lr - min_lr)


def _is_decoupled(name: str) -> bool:
    return name.endswith(EMBEDDING_OR_OUTPUT) and "position" not in name


def _reference_groups(model):
    groups = {"decay": [], "no_decay": [], "decoupled": []}
    for name, p in model.named_parameters():
        key = "decoupled" if _is_decoupled(name) else ("no_decay" if p.ndim == 1 or name.endswith(".bias") else "decay")
        groups[key].append(p)
    return groups


def _train_and_reference(rank, world_size, extra):
    run, ps, rt = engine_for(SCHEDULE + ["--no-pipeline-parallel", *extra])
    from megatron_ds.training.loop import train_step  # noqa: PLC0415

    layout, engine = run.layout, rt.engine
    ref = build_sequential_gpt(layout.model, padded_vocab_size=layout.padded_vocab_size, vocab_size=VOCAB, seed=0)
    ref.load_state_dict(engine.module.state_dict())
    groups = _reference_groups(ref)
    assert groups["decoupled"] and len(groups["decoupled"]) == (2 if "--untie-embeddings-and-output-weights" in extra
                                                                else 1)
    opt = torch.optim.AdamW([{"params": groups["decay"], "weight_decay": 0.1, "kind": "base"},
                             {"params": groups["no_decay"], "weight_decay": 0.0, "kind": "base"},
                             {"params": groups["decoupled"], "weight_decay": 0.1, "kind": "decoupled"}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    for i in range(STEPS):
        batch = micro_batch(100 + i, GB, layout.model.seq_length, keep=0.8)
        train_step(engine, iter([batch]), layout, rt.loss_fn, ps.dp_group)
        for g in opt.param_groups:  # the LR the i-th step applies: the schedule after i steps (i x GB samples)
            g["lr"] = megatron_lr(i * GB, *((DEC_LR, DEC_MIN_LR) if g["kind"] == "decoupled" else (LR, MIN_LR)))
        (tokens, positions), (labels, mask) = batch
        logits = ref((tokens, positions))
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (losses * mask.reshape(-1)).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    applied = {("decoupled" if "max_lr" in g else "base"): g["lr"] for g in engine.optimizer.param_groups}
    names = {id(p): n for n, p in engine.module.named_parameters()}
    decoupled_names = sorted(names[id(p)] for g in engine.optimizer.param_groups if "max_lr" in g for p in g["params"])
    ours = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    theirs = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return applied, decoupled_names, ours, theirs, rt.engine.get_lr()[0]


@pytest.mark.parametrize("extra", [[], ["--untie-embeddings-and-output-weights"]], ids=["tied", "untied"])
def test_decoupled_lr_steps_match_adamw_with_two_lrs(extra):
    applied, decoupled_names, ours, theirs, logged = run_distributed(_train_and_reference, 1, extra, timeout=300)[0]
    assert all(_is_decoupled(n) for n in decoupled_names) and len(decoupled_names) == 1 + bool(extra)
    # after STEPS steps: each group at its own point of the same schedule; the logged LR is the base one
    assert applied["decoupled"] == pytest.approx(megatron_lr(STEPS * GB, DEC_LR, DEC_MIN_LR), rel=1e-12)
    assert applied["base"] == pytest.approx(megatron_lr(STEPS * GB, LR, MIN_LR), rel=1e-12) == logged
    assert ours.keys() == theirs.keys()
    for name in ours:
        # the same fp32 AdamW math on the same gradients (up to summation order): ~1e-7 relative; an
        # update at the wrong LR would be off by ~1e-3 (5x LR x 5 steps)
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-5, atol=2e-6, msg=name)


def _stage_groups(rank, world_size):
    run, ps, rt = engine_for(SCHEDULE + ["--pipeline-model-parallel-size", "2"])
    names = {id(p): n for n, p in rt.engine.module.named_parameters()}
    return [(sorted(names[id(p)] for p in g["params"]), g.get("max_lr"), g.get("min_lr"), g["weight_decay"])
            for g in rt.engine.optimizer.param_groups]


def test_both_copies_of_the_tied_embedding_take_the_decoupled_lr_at_pp2():
    first, last = run_distributed(_stage_groups, 2, timeout=300)
    for stage in (first, last):  # the embedding's stage and the output layer's copy of it
        own = [g for g in stage if g[1] is not None]
        assert len(own) == 1 and own[0][1:] == (DEC_LR, DEC_MIN_LR, 0.1)
        assert len(own[0][0]) == 1 and "word_embeddings.weight" in own[0][0][0]
        assert all("position" not in n for g in stage for n in g[0] if g[1] is not None)


def _resolve(extra):
    cfg, _ = parse_args(BASE + ["--micro-batch-size", "1", "--train-iters", "4", *extra])
    return resolve(cfg, world_size=1, vocab_size=VOCAB, device_type="cpu", family=GPT)


def test_decoupled_flags_are_checked():
    with pytest.raises(ConfigError, match="--decoupled-min-lr 0.5 is above --decoupled-lr 0.1"):
        _resolve(["--lr", "1", "--decoupled-lr", "0.1", "--decoupled-min-lr", "0.5"])
    with pytest.raises(ConfigError, match="--min-lr 0.2 is above --decoupled-lr 0.1"):
        _resolve(["--lr", "1", "--min-lr", "0.2", "--decoupled-lr", "0.1"])
    run = _resolve(["--lr", "1", "--decoupled-min-lr", "0.01"])
    assert any("--decoupled-min-lr 0.01 has no effect without --decoupled-lr" in n for n in run.notes)
    assert run.optimizer.decoupled_lr is None


def test_expert_groups_keep_the_base_lr():
    """--create-moe-param-group splits expert parameters out by the name of their dense group: the
    decoupled groups must not lend theirs (a shared name would move experts to the embedding's LR)."""
    from megatron_ds.model.param_groups import EMBEDDING_OR_OUTPUT, param_groups  # noqa: PLC0415

    model = torch.nn.ModuleDict({"embedding": torch.nn.Embedding(8, 4), "expert": torch.nn.Linear(4, 4, bias=False),
                                 "dense": torch.nn.Linear(4, 4)})
    setattr(model["embedding"].weight, EMBEDDING_OR_OUTPUT, True)
    model["expert"].weight.allreduce, model["expert"].weight.group_name = False, "ep_size_1"  # as DeepSpeed marks experts
    groups = param_groups(model, 0.1, moe_groups=True, decoupled_lr=(DEC_LR, DEC_MIN_LR))
    where = {id(p): g for g in groups for p in g["params"]}
    assert where[id(model["expert"].weight)].get("max_lr") is None and where[id(model["expert"].weight)]["moe"]
    assert where[id(model["embedding"].weight)]["max_lr"] == DEC_LR
    assert where[id(model["dense"].weight)].get("max_lr") is None
