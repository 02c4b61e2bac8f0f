"""--calculate-per-token-loss (Megatron-LM): at data parallel size 2 with 2 micro-batches per step, whose
loss masks keep very different numbers of tokens, one step's gradient (read off an SGD update) and the
reported loss equal a plain-torch reference over the whole global batch: sum of every loss token's cross
entropy / number of loss tokens, as Megatron-LM's finalize_model_grads and train_step normalise them;
validation likewise. Both of DeepSpeed's engines: the pipeline engine (at PP 1) and the plain one."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ds.config import parse_args, resolve
from megatron_ds.errors import ConfigError
from megatron_ds.families.gpt.gpt_family import GPT
from tests.distributed import run_distributed
from tests.training.engine_worker import BASE, VOCAB, engine_for, micro_batch

LR, MICRO, DP, GAS = 0.01, 2, 2, 2
FLAGS = (f"--optimizer sgd --lr {LR} --lr-decay-style constant --weight-decay 0 --clip-grad 0 --train-iters 2 "
         f"--micro-batch-size {MICRO} --global-batch-size {MICRO * DP * GAS} --calculate-per-token-loss").split()
KEEP = {(0, 0): 0.95, (0, 1): 0.25, (1, 0): 0.5, (1, 1): 0.15}  # share of loss tokens of (DP rank, micro-batch)


def _batches(seq):
    batches = {key: micro_batch(10 * key[0] + key[1], MICRO, seq, keep) for key, keep in KEEP.items()}
    counts = [int(b[1][1].sum()) for b in batches.values()]
    assert 0 < min(counts) and max(counts) >= 3 * min(counts), counts  # every micro-batch counts, unequally
    return batches


def _token_losses(module, batch):
    (tokens, positions), (labels, mask) = batch
    logits = module((tokens, positions))
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none")
    return (losses * mask.reshape(-1)).sum(), mask.sum()


def _references(module, batches):
    """(global token mean, mean of the micro-batch means): the flag's loss and the default's."""
    parts = [_token_losses(module, b) for b in batches.values()]
    per_token = sum(s for s, _ in parts) / sum(n for _, n in parts)
    per_micro_batch = sum(s / n for s, n in parts) / len(parts)
    return per_token, per_micro_batch


def _step(rank, world_size, extra):
    from megatron_ds.training.loop import evaluate, train_step  # noqa: PLC0415

    run, ps, rt = engine_for(FLAGS + extra)
    layout, engine = run.layout, rt.engine
    assert (layout.dp, layout.grad_accum_steps) == (DP, GAS)
    batches = _batches(layout.model.seq_length)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    per_token, per_micro_batch = _references(engine.module, batches)
    want = torch.autograd.grad(per_token, params, retain_graph=True)  # the reference gradient, before the step
    default = torch.autograd.grad(per_micro_batch, params)
    mine = iter([batches[(ps.dp_rank, j)] for j in range(GAS)])
    reported = train_step(engine, mine, layout, rt.loss_fn, ps.dp_group, rt.loss_report.token_scale)
    got = [(b - p.detach()) / LR for b, p in zip(before, params)]  # SGD's first step: w -= lr x gradient
    with torch.no_grad():
        after, _ = _references(engine.module, batches)
    validation = evaluate(engine, iter([batches[(ps.dp_rank, j)] for j in range(GAS)]), layout, rt.loss_fn,
                          ps.dp_group, 1, rt.loss_report.token_scale)
    return (reported, float(per_token.detach()), float(per_micro_batch.detach()), validation, float(after),
            [(g, w, d) for g, w, d in zip(got, want, default)])


@pytest.mark.parametrize("engine", [[], ["--no-pipeline-parallel"]], ids=["pipeline-engine", "plain-engine"])
def test_gradient_and_loss_are_the_global_batch_token_mean(engine):
    results = run_distributed(_step, DP, engine, timeout=300)
    for reported, per_token, per_micro_batch, validation, after, grads in results:
        # the masks differ enough that the two normalisations are apart by far more than the tolerance
        # (~1e-2 at initialisation, where every token's loss is near log(vocab)): the test is not vacuous
        assert abs(per_token - per_micro_batch) > 3e-3
        # fp32 sums over 64 tokens in another order: ~1e-7 relative
        assert reported == pytest.approx(per_token, rel=1e-5)
        assert validation == pytest.approx(after, rel=1e-5)
        for got, want, default in grads:
            # (w0 - w1) / lr in fp32 loses ~1e-7 x |w| / lr ~ 1e-6 absolute; the default's gradient is
            # off by ~1e-2 relative or more
            torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5)
        assert any((want - default).abs().max() > 1e-3 for _, want, default in grads)
    assert results[0][0] == results[1][0]  # every data parallel rank reports the same loss


@pytest.mark.parametrize("extra,message", [
    (["--num-experts", "2"], "--calculate-per-token-loss with --num-experts > 1"),
])
def test_refused_combinations(extra, message):
    cfg, _ = parse_args(BASE + FLAGS + extra)
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, world_size=2, vocab_size=VOCAB, device_type="cpu", family=GPT)


def _reported(rank, world_size, extra):
    from megatron_ds.training.loop import evaluate, train_step  # noqa: PLC0415

    run, ps, rt = engine_for(FLAGS + ["--num-layers", "4", *extra])
    layout = run.layout
    batches = _batches(layout.model.seq_length)
    mine = [batches[(ps.dp_rank, j)] for j in range(GAS)]
    reported = train_step(rt.engine, iter(mine), layout, rt.loss_fn, ps.dp_group, rt.loss_report.token_scale)
    validation = evaluate(rt.engine, iter(mine), layout, rt.loss_fn, ps.dp_group, 1, rt.loss_report.token_scale)
    return reported, validation, (layout.pp, layout.own_schedule)


def test_pipeline_stages_and_the_interleaved_executor_report_the_same_token_mean():
    """PP 2 (DeepSpeed's 1F1B engine) and PP 2 with 2 model chunks per rank (the interleaved executor) give
    the PP 1 run's loss before and after the step: the stages that read no labels still join the count,
    and the last stage scales its losses as at PP 1 (whose numbers the test above checks). The layouts
    start from the same weights (the GPT builds each layer from the seed whatever the pipeline split)."""
    base = run_distributed(_reported, DP, [], timeout=300)
    assert base[0] == base[1] and base[0][2] == (1, False)
    for extra, how in ((["--pipeline-model-parallel-size", "2"], (2, False)),
                       (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
                        (2, True))):
        for reported, validation, layout in run_distributed(_reported, 2 * DP, extra, timeout=300):
            assert layout == how
            # other layouts sum in another order: fp32 roundings, ~1e-7 relative
            assert reported == pytest.approx(base[0][0], rel=1e-5)
            assert validation == pytest.approx(base[0][1], rel=1e-5)


def test_pretrain_runs_with_the_three_megatron_lm_flags():
    """The real entry point's loop (its train and validation steps) with --calculate-per-token-loss,
    --decoupled-lr and --use-z-loss together, at DP 2 with --eod-mask-loss."""
    from tests.training.common import TINY_GPT, train_losses  # noqa: PLC0415

    argv = [*TINY_GPT, "--train-iters", "3", "--global-batch-size", "8", "--eval-interval", "2", "--eod-mask-loss",
            "--calculate-per-token-loss", "--decoupled-lr", "3e-3", "--use-z-loss"]
    histories = run_distributed(train_losses, 2, argv, timeout=300)
    assert histories[0] == histories[1] and [it for it, _ in histories[0]] == [1, 2, 3]
    assert all(math.isfinite(loss) for _, loss in histories[0])
