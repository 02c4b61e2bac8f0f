"""The T5 as a DeepSpeed PipelineModule split at --pipeline-model-parallel-split-rank, against the
sequential model in one process (families/t5/t5_model.py).

Three gloo ranks run a 3-stage pipeline with split rank 1: stage 0 holds the encoder, stages 1 and 2
the decoder, so the encoder output crosses stage 1 to reach stage 2 inside the activation tuple and
its gradient must come back as the sum of both decoder stages' cross-attentions. The test process
trains the sequential model from the same specs and seed with the same AdamW on the same
micro-batches. Checked: the stage bounds (encoder stages before the split, decoder stages after),
identical initial weights, the same losses step by step, the same final weights (the encoder's
included: a missing or double-counted encoder-output gradient would move them), and the tied
embedding's copies (stages 0, 1, 2) still identical. Activation recompute is on (interval 1), so the
tuples also go through our checkpoint inside DeepSpeed's pipeline.
"""
from __future__ import annotations

import torch

from megatron_ds.config.layout import resolve_model_config
from megatron_ds.config.schema import ModelConfig
from tests.distributed import run_distributed
from tests.families.gpt.test_pipeline import train_sequentially

VOCAB, ENC, DEC = 64, 10, 6
MICRO, GAS, STEPS = 2, 2, 3
LR = 1e-2
# as tests/families/gpt/test_pipeline.py: fp32, the same kernels on the same numbers; only the order of
# gradient sums differs (tied copies all-reduced across stages; the encoder output's gradient summed
# per stage then across stages), a few ulps that AdamW carries through three steps.
TOL = dict(rtol=1e-5, atol=1e-5)


def _cfg():
    return resolve_model_config(ModelConfig(num_layers=2, decoder_num_layers=4, seq_length=ENC,
                                            max_position_embeddings=ENC, hidden_size=32, num_attention_heads=4,
                                            hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.1,
                                            pipeline_model_parallel_split_rank=1))


def _micro_batches():
    """((enc tokens, dec tokens, enc flags, dec flags), (labels, loss_mask)) with padding on both sides."""
    g = torch.Generator().manual_seed(42)
    out = []
    for _ in range(GAS):
        enc = torch.randint(1, VOCAB, (MICRO, ENC), generator=g)
        dec = torch.randint(1, VOCAB, (MICRO, DEC), generator=g)
        ef, df = torch.ones(MICRO, ENC, dtype=torch.long), torch.ones(MICRO, DEC, dtype=torch.long)
        ef[0, 7:] = 0
        df[1, 4:] = 0
        labels = torch.randint(1, VOCAB, (MICRO, DEC), generator=g)
        out.append(((enc * ef, dec * df, ef, df), (labels * df, df.float())))
    return out * STEPS


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-5, weight_decay=0.01)


def _train_pipeline(rank, world_size):
    import deepspeed
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    from megatron_ds.families.t5.t5_model import build_pipeline_t5
    from megatron_ds.parallel.random import set_parallel_seeds

    deepspeed.init_distributed(dist_backend="gloo")
    m = _cfg()
    topology = PipeModelDataParallelTopology(num_pp=3, num_mp=1, num_dp=1)
    set_parallel_seeds(1234, 0)
    model = build_pipeline_t5(m, topology, decoder_num_layers=4, split_rank=1, padded_vocab_size=VOCAB,
                              tp_group=None, seed=7, activation_checkpoint_interval=1)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    config = {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
              "gradient_accumulation_steps": GAS, "steps_per_print": 10 ** 9, "gradient_clipping": 0.0,
              "pipeline": {"pipe_partitioned": False, "grad_partitioned": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=_optimizer(model.parameters()), config=config)
    batches = iter(_micro_batches())
    losses = [engine.train_batch(batches).item() for _ in range(STEPS)]
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"stage": model.stage_id, "parts": list(model.parts), "initial": initial, "final": final,
            "losses": losses}


def _train_sequential():
    from megatron_ds.families.t5.t5_model import build_sequential_t5
    from megatron_ds.parallel.random import set_parallel_seeds

    set_parallel_seeds(1234, 0)
    model = build_sequential_t5(_cfg(), decoder_num_layers=4, padded_vocab_size=VOCAB, seed=7)
    return train_sequentially(model, _optimizer(model.parameters()), _micro_batches(), STEPS, GAS)


def test_split_rank_pipeline_trains_like_the_sequential_model():
    stages = run_distributed(_train_pipeline, 3, timeout=600)
    initial, final, losses = _train_sequential()

    # specs: 0 embed | 1-2 encoder | 3 encoder norm | 4 embed | 5-8 decoder | 9 norm | 10 head
    assert stages[0]["parts"] == [0, 4, 7, 11]
    for s in stages:
        for key, value in s["initial"].items():
            assert torch.equal(value, initial[key]), f"stage {s['stage']}: initial {key} differs"
    assert {k.split(".")[0] for k in stages[0]["initial"]} == {"tied_modules", "1", "2", "3"}
    assert {k.split(".")[0] for k in stages[2]["initial"]} == {"tied_modules", "7", "8", "9"}
    assert losses[-1] < losses[0] - 0.05, losses
    for s in stages:
        torch.testing.assert_close(torch.tensor(s["losses"]), torch.tensor(losses), **TOL)
        for key, value in s["final"].items():
            torch.testing.assert_close(value, final[key], **TOL, msg=lambda m: f"stage {s['stage']} {key}: {m}")
    for key in stages[0]["final"]:
        if key.startswith("tied_modules"):  # one all-reduced gradient, one update: bit for bit
            assert torch.equal(stages[0]["final"][key], stages[1]["final"][key])
            assert torch.equal(stages[0]["final"][key], stages[2]["final"][key])
