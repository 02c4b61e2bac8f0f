"""The GPT as a DeepSpeed PipelineModule (PP = 2, gloo) against the sequential model in one process.

Two ranks run ``deepspeed.initialize`` + ``train_batch`` on a 2-stage pipeline with a plain torch
AdamW; the test process trains the sequential model built from the same specs and seed with the
same AdamW on the same micro-batches. Checked: identical initial weights on each stage, the same
losses step by step, the tied embedding copies still identical after the steps, and each stage's
parameter count as ``stage_parameter_counts`` predicts. The GPT-2 case runs with full activation
recompute (our RNG-replaying checkpoint inside DeepSpeed's pipeline), the Llama-style case with
selective recompute and document masking, so document ids cross the stage boundary.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from tests.distributed import run_distributed

VOCAB = 64
SEQ = 8
EOD = 0
MICRO, GAS, STEPS = 2, 2, 3
LR = 1e-2  # large enough that three steps move the loss visibly

# fp32 and the very same kernels on the same numbers; the only reordering is the tied embedding
# gradient (DeepSpeed all-reduces the two stages' accumulated sums, autograd accumulates per
# micro-batch), a few ulps that AdamW carries through three steps: 1e-5 relative on O(1) losses and
# weights leaves two orders of magnitude of headroom, while one mis-routed micro-batch, a missing
# tied-gradient reduction or wrong recompute changes the losses in the 3rd digit.
TOL = dict(rtol=1e-5, atol=1e-5)

_BASE = dict(num_layers=4, seq_length=SEQ, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
             attention_dropout=0.0, init_method_std=0.1)
CASES = {
    # recompute interval 2: chunks that mix the embedding or the head with transformer layers
    "gpt2-full-recompute": (dict(), dict(), 2),
    "llama-selective-recompute-reset-mask": (
        dict(num_key_value_heads=2, ffn_hidden_size=64, use_rotary_position_embeddings=True, swiglu=True,
             normalization="rmsnorm", add_bias_linear=False, untie_embeddings_and_output_weights=True),
        dict(reset_attention_mask=True, eod_token=EOD, recompute_granularity="selective"), 0),
}


def _case(name):
    over, spec_kwargs, interval = CASES[name]
    return resolve_model_config(ModelConfig(**_BASE, **over)), spec_kwargs, interval


def _micro_batches():
    """STEPS * GAS micro-batches ((tokens, position_ids), (labels, loss_mask)), the same everywhere:
    the same GAS micro-batches every step, so that the loss can fall (random tokens are otherwise
    at their entropy, ln(VOCAB), from the start)."""
    g = torch.Generator().manual_seed(42)
    out = []
    for _ in range(GAS):
        tokens = torch.randint(1, VOCAB, (MICRO, SEQ + 1), generator=g)
        tokens[:, 3] = EOD
        loss_mask = (torch.rand(MICRO, SEQ, generator=g) > 0.1).float()
        out.append(((tokens[:, :-1].clone(), torch.arange(SEQ).expand(MICRO, SEQ).clone()),
                    (tokens[:, 1:].clone(), loss_mask)))
    return out * STEPS


def _optimizer(params):
    # eps well above gradient noise: some gradients are zero in exact arithmetic (a key bias shifts
    # every score of a row alike, which softmax ignores) and ~1e-10 in floating point; with a tiny
    # eps Adam would blow that summation-order noise up to lr-sized, run-dependent updates.
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01)


def _train_pipeline(rank, world_size, name):
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron_ds.families.gpt.gpt_model import build_pipeline_gpt
    from megatron_ds.parallel.random import set_parallel_seeds

    deepspeed.init_distributed(dist_backend="gloo")
    cfg, spec_kwargs, interval = _case(name)
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=1)
    set_parallel_seeds(1234, 0)
    model = build_pipeline_gpt(cfg, topology, padded_vocab_size=VOCAB, tp_group=None, seed=7,
                               activation_checkpoint_interval=interval, **spec_kwargs)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    num_params = sum(p.numel() for p in model.parameters())
    config = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 9,
              "gradient_clipping": 0.0}  # DeepSpeed 0.19 clips at 1.0 unless told otherwise
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model.parameters()), config=config)
    batches = iter(_micro_batches())
    losses = [engine.train_batch(batches).item() for _ in range(STEPS)]
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"stage": model.stage_id, "initial": initial, "final": final, "losses": losses, "num_params": num_params}


def train_sequentially(model, optimizer, micro_batches, steps: int, gas: int) -> tuple[dict, dict, list[float]]:
    """The single-process reference of a pipeline test: (initial weights, final weights, the mean loss
    of each step) after `steps` steps of `gas` micro-batches each, taken in order from micro_batches."""
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    batches = iter(micro_batches)
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(gas):
            inputs, labels = next(batches)
            loss = model.loss_fn(model(inputs), labels)
            (loss / gas).backward()  # DeepSpeed scales each micro-batch's loss by 1/gas likewise
            total += loss.item()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total / gas)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return initial, final, losses


def _train_sequential(name):
    from megatron_ds.families.gpt.gpt_model import build_sequential_gpt
    from megatron_ds.parallel.random import set_parallel_seeds

    cfg, spec_kwargs, interval = _case(name)
    set_parallel_seeds(1234, 0)
    model = build_sequential_gpt(cfg, padded_vocab_size=VOCAB, seed=7, activation_checkpoint_interval=interval,
                                 **spec_kwargs)
    initial, final, losses = train_sequentially(model, _optimizer(model.parameters()), _micro_batches(), STEPS, GAS)
    return model, initial, final, losses


@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_of_two_stages_trains_like_the_sequential_model(name):
    stages = run_distributed(_train_pipeline, 2, name, timeout=240)
    model, initial, final, losses = _train_sequential(name)

    assert [s["stage"] for s in stages] == [0, 1]
    assert [s["num_params"] for s in stages] == model.stage_parameter_counts(2)
    tied = not _case(name)[0].untie_embeddings_and_output_weights
    for s in stages:
        for key, value in s["initial"].items():
            # Same seed per layer index -> the very same numbers, whichever stage built the layer
            # (the last stage's tied copy gets the first stage's weights by broadcast).
            assert torch.equal(value, initial[key]), f"stage {s['stage']}: initial {key} differs"
    # Every layer lives on exactly one stage (the tied word embedding on both).
    keys = [set(s["initial"]) for s in stages]
    shared = keys[0] & keys[1]
    assert shared == ({"tied_modules.embed.word_embeddings.weight"} if tied else set())
    assert keys[0] | keys[1] == set(initial)

    assert losses[-1] < losses[0] - 0.05, losses  # it trains
    for s in stages:  # the loss is broadcast from the last stage to every stage
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(losses), **TOL)
    for s in stages:
        for key, value in s["final"].items():
            torch.testing.assert_close(value, final[key], **TOL, msg=lambda m: f"stage {s['stage']} {key}: {m}")
    if tied:
        key = "tied_modules.embed.word_embeddings.weight"
        # Both copies got the same all-reduced gradient and the same update: bit for bit equal.
        assert torch.equal(stages[0]["final"][key], stages[1]["final"][key])


def _recompute_chunks(rank, world_size, interval):
    import deepspeed

    from megatron_ds.families.gpt.gpt_model import build_pipeline_gpt
    from megatron_ds.parallel.groups import ParallelState

    deepspeed.init_distributed(dist_backend="gloo")
    ps = ParallelState(1, 1)
    cfg = _case("gpt2-full-recompute")[0]
    model = build_pipeline_gpt(cfg, ps.topology, padded_vocab_size=VOCAB, tp_group=ps.tp_group,
                               seed=1, activation_checkpoint_interval=interval)
    funcs = model.forward_funcs
    recomputed = set()
    for start in range(0, len(funcs), interval):
        chunk = funcs[start:start + interval]
        if model._is_checkpointable(chunk):
            recomputed.update(type(f).__name__ + str(i) for i, f in enumerate(chunk, start))
    return sorted(n for n in recomputed if n.startswith("ParallelTransformerLayer"))


@pytest.mark.parametrize("interval", [1, 2, 3])
def test_full_recompute_covers_every_transformer_layer(interval):
    """DeepSpeed chunks a stage by --recompute-num-layers from its first module; chunks that also
    hold the embedding or the head must still be recomputed."""
    layers = run_distributed(_recompute_chunks, 1, interval, timeout=300)[0]
    assert len(layers) == _BASE["num_layers"]


def test_partition_method_matches_config_default():
    from megatron_ds.config.schema import ParallelConfig
    from megatron_ds.model.pipeline_model import PARTITION_METHOD

    assert ParallelConfig().pipeline_partition_method == PARTITION_METHOD


def test_specs_put_one_transformer_layer_per_spec():
    from deepspeed.runtime.pipe.module import LayerSpec, TiedLayerSpec

    from megatron_ds.families.gpt.gpt_model import gpt_layer_specs

    from megatron_ds.model.pipeline_model import TRANSFORMER_LAYER_CLASS

    cfg = dataclasses.replace(_case("gpt2-full-recompute")[0], num_layers=3)
    specs = gpt_layer_specs(cfg, padded_vocab_size=VOCAB)
    names = [s.typename.__name__ for s in specs]
    assert names == ["LanguageModelEmbedding"] + [TRANSFORMER_LAYER_CLASS] * 3 + ["FinalNorm", "LanguageModelEmbedding"]
    assert isinstance(specs[0], TiedLayerSpec) and isinstance(specs[-1], TiedLayerSpec)
    assert specs[0].key == specs[-1].key and specs[-1].forward_fn is not None
    untied = gpt_layer_specs(dataclasses.replace(cfg, untie_embeddings_and_output_weights=True),
                             padded_vocab_size=VOCAB)
    assert not any(isinstance(s, TiedLayerSpec) for s in untied) and all(isinstance(s, LayerSpec) for s in untied)
