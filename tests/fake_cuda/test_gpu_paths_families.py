"""The CUDA code paths of the BERT and T5 families (pretrain_bert.py, pretrain_t5.py), executed on
a CPU as tests/fake_cuda/test_gpu_paths.py does for the GPT: the model as the family's CLI builds it
(flags -> prepare -> select_device -> build_module with the family's builder -> build_optimizer)
runs forward, backward and a fused AdamW step on fake tensors on ``cuda``; a CPU tensor anywhere in
the computation raises FakeTensorDeviceMismatchError, and every parameter, gradient and optimizer
state is checked for device and dtype. Micro-batches are the family's own collator's, from its
datasets (CPU tensors, as the loader yields them), moved as DeepSpeed's pipeline engine moves them.

Dropout is on (the parity tests turn it off): the CUDA RNG tracker's forks in self- and T5's
cross-attention run too. Later pipeline stages get what the stage before sends (BERT: the hidden
state and the padding mask; T5's decoder stages: the encoder output, the decoder tokens and both
padding flags), and the gradient of each floating tensor received must come back on the device
(what the stage sends back)."""
from __future__ import annotations

import pytest
import torch

from megatron_ds import fake_cuda
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.t5.t5_family import T5
from megatron_ds.model.loss_report import LossReport
from megatron_ds.parallel.groups import ParallelState
from megatron_ds.training.device import select_device
from megatron_ds.training.engine import build_module
from megatron_ds.training.optimizer import build_optimizer
from tests.data.test_bert_t5_datasets import random_documents, write_dataset, write_vocab
from tests.fake_cuda.conftest import build_run, check_trained, fake_world, loader_batches, stage_step
from tests.fake_cuda.test_gpu_paths import FULL
from tests.families.bert.test_bert_parity import TINY_BERT
from tests.families.t5.test_t5_parity import RELATIVE, TINY_T5

DROPOUT = "--hidden-dropout 0.1 --attention-dropout 0.1".split()
FAMILIES = {"bert": (BERT, TINY_BERT), "t5": (T5, TINY_T5)}
SPLIT = ["--pipeline-model-parallel-split-rank", "1"]

# (family, flags, tensor parallel, pipeline parallel, this process's rank)
CASES = {
    # padding masks, token types, the binary head and its sentence-order loss
    "bert-bf16": ("bert", ["--bf16"], 1, 1, 0),
    # the last stage: the padding mask arrives from stage 0 with the hidden state
    "bert-fp16-pp2-last-stage": ("bert", ["--fp16"], 1, 2, 1),
    # the decoder stage: the encoder output and both stacks' flags arrive from the encoder stage
    "t5-bf16-pp2-split1-decoder-stage": ("t5", ["--bf16", *SPLIT], 1, 2, 1),
    # relative position biases: each stack's float bias mask built on the device from its table
    "t5-fp16-relative": ("t5", ["--fp16", *RELATIVE], 1, 1, 0),
    "t5-bf16-relative-tp2-pp2-split1-decoder-stage": ("t5", ["--bf16", *RELATIVE, *SPLIT], 2, 2, 3),
    # the MLM head gathers the sequence-parallel hidden state (TP rank 1)
    "bert-bf16-tp2-sequence-parallel": ("bert", ["--bf16", "--sequence-parallel"], 2, 1, 1),
    # DeepSpeed's activation checkpointing of the encoder and decoder layers, their tuple inputs included
    "t5-fp16-full-recompute": ("t5", ["--fp16", *FULL], 1, 1, 0),
    # the plain engine's module (SequentialModel); BERT without the binary head: the MLM logits alone
    "bert-fp16-no-pipeline-no-binary-head": ("bert", ["--fp16", "--no-pipeline-parallel", "--bert-no-binary-head"],
                                             1, 1, 0),
    "t5-bf16-no-pipeline": ("t5", ["--bf16", "--no-pipeline-parallel"], 1, 1, 0),
    # FP8 GEMMs in every linear layer of the encoder and decoder layers, cross-attention included (counted below)
    "t5-bf16-no-pipeline-fp8": ("t5", ["--bf16", "--no-pipeline-parallel", "--fp8-hybrid"], 1, 1, 0),
}


def _micro_batch(family, run, tokenizer):
    """A real micro-batch: the family's collator over its (--mock-data) training dataset's samples."""
    train, _, _ = family.build_datasets(run, tokenizer, (8, 0, 0), lambda *a: None)
    collator = family.make_collator(run, tokenizer)
    return collator([train[i] for i in range(run.layout.micro_batch_size)])


def _received(name, run, batch, device, dtype):
    """What the previous stage sends this one (on the device, as DeepSpeed's pipeline engine
    receives it; floating tensors require a gradient, to be sent back)."""
    m, b = run.layout.model, run.layout.micro_batch_size
    inputs, _ = batch

    def hidden(s):
        return torch.randn(s, b, m.hidden_size, device=device, dtype=dtype, requires_grad=True)

    if name == "bert":  # BertEmbedding's (hidden [s, b, h], padding_mask)
        return hidden(m.seq_length), inputs[2].to(device, non_blocking=True)
    # T5EncoderFinalNorm's (encoder output [s_enc, b, h], decoder tokens, encoder flags, decoder flags)
    _, dec_tokens, enc_flags, dec_flags = (t.to(device, non_blocking=True) for t in inputs)
    return hidden(m.seq_length), dec_tokens, enc_flags, dec_flags


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_step_on_cuda(case, gpu, monkeypatch):
    name, flags, tp, pp, rank = CASES[case]
    family, base = FAMILIES[name]
    run, tokenizer = build_run([*DROPOUT, *flags], tp, pp, base=base, family=family)
    half = torch.float16 if "--fp16" in flags else torch.bfloat16
    batch = _micro_batch(family, run, tokenizer)
    scaled_mm, real_scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: scaled_mm.append(1) or real_scaled_mm(*a, **k))
    report = LossReport(family.loss_names(run.layout))
    with fake_world(tp * pp, rank), fake_cuda.activate():
        ps = ParallelState(tp, pp)
        device = select_device(0)
        assert device == torch.device("cuda", 0)
        model = build_module(run, ps, device, family.eod_token(tokenizer), report, build=family.build_model)
        if hasattr(model, "_precompute_checkpointable_values"):
            model._precompute_checkpointable_values()  # DeepSpeed's PipelineEngine does this at start
        received = None if ps.is_first_stage else _received(name, run, batch, device, half)
        loss = stage_step(model, ps, batch, device, received)
        optimizer, desc = build_optimizer(model, run.optimizer, device)
        optimizer.step()
    assert desc == "torch.optim.AdamW(fused=True)"
    check_trained(model, optimizer, device, half)
    assert loss is not None  # every case runs a last stage: the family's loss on the device
    # FP8: 3 GEMMs per linear layer, 4 in an encoder layer (QKV, attention output, MLP in and out) and 7 in a
    # decoder layer (its cross-attention's query, key/value and output too); none without FP8
    m = run.layout.model
    fp8_gemms = 3 * (4 * m.num_layers + 7 * (m.decoder_num_layers or m.num_layers))
    assert len(scaled_mm) == (fp8_gemms if "--fp8-hybrid" in flags else 0)
    for t in received or ():
        if t.is_floating_point():  # the gradient this stage sends back
            assert t.grad is not None and t.grad.device == device and t.grad.dtype == half


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A small --split-sentences dataset and WordPiece vocabulary (tests/data/test_bert_t5_datasets.py's)."""
    root = tmp_path_factory.mktemp("corpus")
    return write_dataset(root / "corpus_text_sentence", random_documents(3)), write_vocab(root / "vocab.txt")


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("source", ["mock", "indexed"])
def test_pinned_loader_batches(name, source, corpus, gpu, monkeypatch, tmp_path):
    """Every tensor of the family's micro-batches, from its --mock-data or its indexed-data samples
    (Megatron's BERT / T5 samples: ``bert_t5_datasets``), survives the loader's pinning (page-locked
    memory refuses a stride-0 view, the crash of the GPT's first H100 run) through a worker
    process, and the engine's non_blocking copy to the device keeps its shape and dtype."""
    family, base = FAMILIES[name]
    flags = ["--num-workers", "1", "--bf16"]
    if source == "indexed":
        prefix, vocab = corpus
        drop = base.index("--vocab-size")  # the vocabulary is the file's
        base = [f for i, f in enumerate(base) if f != "--mock-data" and i not in (drop, drop + 1)]
        flags += ["--data-path", prefix, "--vocab-file", vocab, "--split", "1,0,0", "--data-cache-path", str(tmp_path)]
        if name == "t5":
            flags += ["--vocab-extra-ids", "100"]  # pretrain_t5.py's sentinels
    run, tokenizer = build_run(flags, 1, 1, base=base, family=family)
    train, _, _ = family.build_datasets(run, tokenizer, (8, 0, 0), lambda *a: None)
    with monkeypatch.context() as patch:  # (not in fake mode: it would run the copies below for real)
        patch.setattr(torch.cuda, "is_available", lambda: True)  # what the DataLoader asks before pinning
        patch.setattr(torch.cuda, "_lazy_init", lambda: None)  # its pin thread's device query
        batches = loader_batches(train, run, family.make_collator(run, tokenizer))
    # every sample once (the indexed datasets hold an epoch of their samples mapping, more than asked)
    assert len(batches) == len(train) // run.layout.micro_batch_size
    tensors = [t for inputs, labels in batches for t in (*inputs, *labels)]
    assert all(t.is_pinned() for t in tensors)  # (asked outside fake mode: inside, a real tensor is faked)
    with fake_cuda.activate():
        for t in tensors:
            moved = t.to("cuda", non_blocking=True)
            assert moved.device.type == "cuda" and moved.shape == t.shape and moved.dtype == t.dtype
