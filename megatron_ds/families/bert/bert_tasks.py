"""BERT fine-tuned for classification (GLUE MNLI, QQP) and multiple choice (RACE), as Megatron-LM's
tasks/ builds it: a ``ModelFamily`` per task whose model is BERT's embedding, transformer layers and
final norm (``bert_model.bert_layer_specs``, the same layer indices and parameter names, so a
pretraining checkpoint's files fill them) followed by a task head in place of the MLM and binary heads:

    hidden [s, b, h] --pooler (dense + tanh of [CLS])--> dropout (--hidden-dropout) --linear--> logits

megatron/model/classification.py ``Classification``: ``num_classes`` outputs; multiple_choice.py
``MultipleChoice``: one output per (question, option) sequence, viewed as ``[questions, 4]``. The
pooler is the pretrained one (the binary head's ``pooler``, same name and layer index); the last
linear (``classification_head``, Megatron's ``get_linear_layer``: normal(--init-method-std), zero
bias) starts random. Token types are always on (``num_tokentypes=2``, as Megatron's task models).

The loss is tasks/finetune_utils.py's cross entropy of the logits with the label; the loss function
also reports ``accuracy`` (the fraction of argmax == label of the micro-batch) to the loss report,
whose mean over a validation pass of equal micro-batches is Megatron's correct / total.
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from megatron_ds.config.family import ModelFamily
from megatron_ds.config.layout import StageParams
from megatron_ds.errors import DataError
from megatron_ds.families.bert.bert_family import BERT
from megatron_ds.families.bert.bert_model import bert_layer_specs, linear_layer
from megatron_ds.families.bert.bert_params import bert_pipeline_layers
from megatron_ds.model.pipeline_model import PARTITION_METHOD, PipelineModel, SequentialModel, stage_of_specs
from megatron_ds.model.transformer import hidden_dropout
from megatron_ds.parallel.mappings import gather_from_sequence_parallel_region
from megatron_ds.parallel.partition import partition_stages

ACCURACY = "accuracy"
HEAD_LAYERS = 3  # bert_layer_specs' BertHeads, tied output projection and MLM bias: replaced by the task head


@dataclasses.dataclass(frozen=True)
class Task:
    """A task of tasks/main.py: its head's outputs and how its samples are grouped."""
    name: str
    num_classes: int  # classification outputs; 1 (one score per option) for multiple choice
    num_choices: int = 1  # sequences per sample (RACE: 4, collapsed into the batch dimension)


TASKS = {"MNLI": Task("MNLI", 3), "QQP": Task("QQP", 2), "RACE": Task("RACE", 1, num_choices=4)}


class TaskHead(nn.Module):
    """Pooler, dropout and the task's linear: ``[s, b, h]`` -> logits ``[b, outputs]`` (replicated over TP)."""

    def __init__(self, hidden_size: int, outputs: int, *, init_method_std: float, dropout: float, tp_group=None,
                 sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel, self.dropout = tp_group, sequence_parallel, dropout
        self.pooler = linear_layer(hidden_size, hidden_size, init_method_std, params_dtype, device)
        self.classification_head = linear_layer(hidden_size, outputs, init_method_std, params_dtype, device)

    def forward(self, hidden: torch.Tensor):
        if self.sequence_parallel:  # position 0 lives on TP rank 0's shard: gather the sequence
            hidden = gather_from_sequence_parallel_region(hidden, self.tp_group, tensor_parallel_output_grad=False)
        pooled = torch.tanh(self.pooler(hidden[0]))
        # replicated activations: the same mask on every TP rank (the default generator, hidden_dropout)
        return self.classification_head(hidden_dropout(pooled, self.dropout, self.training, False))


def task_loss_fn(logits, labels, *, num_choices: int, report=None) -> torch.Tensor:
    """Cross entropy of ``logits`` (``[b * num_choices, outputs]``) with ``labels[0]`` (``[b]``), in fp32;
    the micro-batch's accuracy goes to ``report``."""
    (label,) = labels
    logits = logits.float().view(label.shape[0], -1) if num_choices > 1 else logits.float()
    if report is not None:
        report.add(ACCURACY, (logits.argmax(dim=-1) == label).float().mean())
    return F.cross_entropy(logits, label)


def task_layer_specs(task: Task, model_cfg, *, padded_vocab_size: int, **spec_kwargs) -> list:
    """BERT's specs up to its final norm (with token types), then the task head at the heads' index."""
    m = dataclasses.replace(model_cfg, bert_binary_head=True)
    specs = bert_layer_specs(m, padded_vocab_size=padded_vocab_size, **spec_kwargs)[:-HEAD_LAYERS]
    specs.append(LayerSpec(TaskHead, m.hidden_size, task.num_classes, init_method_std=m.init_method_std,
                           dropout=m.hidden_dropout, tp_group=spec_kwargs.get("tp_group"),
                           sequence_parallel=spec_kwargs.get("sequence_parallel", False),
                           params_dtype=spec_kwargs.get("params_dtype", torch.float32),
                           device=spec_kwargs.get("device")))
    return specs


def count_task_parameters(task: Task, m, padded_vocab: int, tp: int, pp: int, partition_method: str | None = None,
                          ep: int = 1, etp: int = 1) -> tuple[int, tuple[StageParams, ...]]:
    """``ModelFamily.count_parameters`` of the task model: BERT's layers up to the final norm
    (``bert_params.bert_pipeline_layers``, token types on), then the pooler and the task's linear."""
    h = m.hidden_size
    head = h * h + h + h * task.num_classes + task.num_classes
    layers = bert_pipeline_layers(dataclasses.replace(m, bert_binary_head=True), padded_vocab, tp)[:-HEAD_LAYERS]
    layers.append(("TaskHead", head, head))
    parts = partition_stages(pp, partition_method or PARTITION_METHOD, [name for name, _, _ in layers],
                             lambda: [count for _, count, _ in layers])
    n = m.num_layers
    stages = tuple(StageParams(s, (min(max(parts[s] - 1, 0), n), min(max(parts[s + 1] - 1, 0), n)),
                               sum(count for _, count, _ in layers[parts[s]:parts[s + 1]])) for s in range(pp))
    return sum(total for _, _, total in layers), stages


def _specs(task: Task, run, tp_group, device):
    from megatron_ds.training.engine import model_kwargs  # noqa: PLC0415

    kwargs = model_kwargs(run, tp_group, eod_token=None, device=device)
    build = {k: kwargs.pop(k) for k in ("seed", "activation_checkpoint_interval")}
    for unused in ("reset_attention_mask", "eod_token", "ep_size"):  # the GPT's (BERT has no MoE)
        kwargs.pop(unused, None)
    return task_layer_specs(task, run.layout.model, **kwargs), build


def build_task_model(task: Task, pretrained, run, ps, eod_token, device, loss_report):
    """This rank's task model (pipeline or plain module), filled from ``pretrained`` (a callable that
    loads the pretraining checkpoint into a module, or None)."""
    specs, build = _specs(task, run, ps.tp_group, device)
    loss_fn = functools.partial(task_loss_fn, num_choices=task.num_choices, report=loss_report)
    if run.layout.use_pipeline:
        model = PipelineModel(specs, topology=ps.topology, loss_fn=loss_fn,
                              partition_method=run.distributed.pipeline_partition_method, **build)
    else:
        model = SequentialModel(specs, loss_fn=loss_fn, **build)
    if pretrained is not None:
        pretrained(model, run, ps)
    return model


def build_task_stage(task: Task, run, stage: int, tp_group, eod_token):
    """Stage ``stage`` of the task model on the meta device (--dry-run's build)."""
    specs, build = _specs(task, run, tp_group, "meta")
    layout = run.layout
    if not layout.use_pipeline:
        return SequentialModel(specs, **build)
    return stage_of_specs(specs, num_stages=layout.pp, stage=stage,
                          partition_method=run.distributed.pipeline_partition_method or PARTITION_METHOD, **build)


class TaskCollator:
    """Stacks task samples into ``((text, types, padding_mask), (label,))``, the options of a multiple
    choice sample collapsed into the batch dimension (Megatron's ``sample_multiplier``)."""

    def __init__(self, vocab_size: int, source: str):
        self.vocab_size, self.source = vocab_size, source

    def __call__(self, samples):
        text = np.stack([np.asarray(s["text"]) for s in samples])
        if text.max(initial=0) >= self.vocab_size or text.min(initial=0) < 0:
            raise DataError(f"a token id of {self.source} is outside the model's vocabulary (size {self.vocab_size})")
        seq = text.shape[-1]

        def flat(key):
            return torch.from_numpy(np.stack([np.asarray(s[key]) for s in samples]).reshape(-1, seq)).long()

        label = torch.tensor([int(s["label"]) for s in samples], dtype=torch.long)
        return (flat("text"), flat("types"), flat("padding_mask")), (label,)


def task_family(task: Task, datasets: tuple, pretrained=None) -> ModelFamily:
    """The ``ModelFamily`` that fine-tunes ``task`` on ``datasets`` ((train, valid, test), made by the
    caller: their lengths set the run's iterations), its model filled by ``pretrained`` (see
    ``build_task_model``). Its name is what its checkpoints record (``bert_mnli``, ...)."""
    return dataclasses.replace(
        BERT, name=f"bert_{task.name.lower()}", label=f"BERT {task.name}",
        count_parameters=functools.partial(count_task_parameters, task),
        build_model=functools.partial(build_task_model, task, pretrained),
        build_stage=functools.partial(build_task_stage, task),
        build_datasets=lambda run, tokenizer, num_samples, log: datasets,
        make_collator=lambda run, tokenizer: TaskCollator(tokenizer.vocab_size, f"the {task.name} data"),
        layer_specs=lambda model, padded_vocab_size, **kw: task_layer_specs(
            task, model, padded_vocab_size=padded_vocab_size, **kw),
        loss_names=lambda layout: (ACCURACY,), universal_checkpoints=False, quickstart=None,
        evaluation=None, hf=None, plannable=False)
