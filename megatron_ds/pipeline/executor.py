"""Executes the interleaved 1F1B schedule (``megatron_ds.parallel.schedules``) inside DeepSpeed's
plain engine, which keeps owning the optimizer, ZeRO-1, loss scaling, clipping and checkpoints.

DeepSpeed's pipeline engine runs plain 1F1B only, so this rank's model chunks
(``megatron_ds.pipeline.chunks.ModelChunks``) are given to ``deepspeed.initialize`` as one
ordinary module, and ``InterleavedPipeline.train_batch`` walks this rank's step list:

* forward (chunk c, micro-batch j): the input is the micro-batch's tokens on virtual stage 0, else
  the activation received from the previous rank; the chunk runs through ``engine(x, chunk=c)``;
  the output is sent on, or on the last virtual stage turned into the loss;
* backward: the last virtual stage runs ``engine.backward(loss)`` (DeepSpeed divides by the
  micro-batches per step and applies the fp16 loss scale -- under ZeRO 0 the loss itself does,
  ``training.engine.scale_fp16_loss``); other stages receive the gradient of their output, which
  already carries both factors, and run ``engine.backward`` on the scalar
  ``sum(output * grad) / loss_scale`` with ``scale_wrt_gas=False`` (``loss_scale``: what
  ``engine.backward`` multiplies by, ``ds_compat.backward_loss_scale``), whose parameter gradients
  are exactly those of ``output.backward(grad)`` (the scale is a power of two: dividing and
  multiplying by it is exact). The input's gradient goes to the previous rank;
* after the last backward, as DeepSpeed's ``PipelineEngine`` does: the two copies of the tied
  word embedding (first and last stage) all-reduce their gradients (Megatron's
  ``_allreduce_word_embedding_grads``), then at a forced accumulation boundary the engine reduces
  gradients over data parallel ranks and steps (clipping, overflow skip, LR schedule).

ZB-H1 (``--enable-zbh1-pipeline``, ``parallel.schedules.zbh1_schedule``) runs here too, with one
chunk per rank: an input backward runs ``engine.backward`` while ``parallel.weight_grad``'s store
defers the linear layers' weight gradients; a weight pass runs the oldest deferred micro-batch's.
Megatron-DeepSpeed instead replaces DeepSpeed's ``TrainSchedule`` class and extends
``PipelineEngine._INSTRUCTION_MAP`` process-wide, swapping its linear layer's backward during each
``BackwardOnlyPass`` (``megatron/initialize.py``, ``deepspeed_zbh1_engine.py``). This executor
already sends tagged messages, reduces the tied embedding and writes ``PipelineModule``'s checkpoint
files, and its step lists are tested without processes; driving it from a ZB-H1 list touches no
pipeline-engine internals, only the bf16 optimizer's gradient buffers around a weight pass
(``ds_compat.outside_backward_gradients``), and the checkpoints stay those of a 1F1B run.

The object stands in for the engine everywhere else (attributes fall through to it), so the
training loop and checkpoint code treat it like DeepSpeed's pipeline engine (``train_batch``,
``eval_batch``). Checkpoints hold the same per-layer files a non-interleaved pipeline writes.
"""
from __future__ import annotations

import os
from collections import deque

import torch
import torch.distributed as dist

from megatron_ds import ds_compat
from megatron_ds.config.moe_params import is_moe
from megatron_ds.parallel.schedules import (BACKWARD, FORWARD, INPUT_BACKWARD, WEIGHT, forward_only_schedule,
                                       pipeline_schedule, zbh1_schedule)
from megatron_ds.parallel.utils import PRECISION_DTYPES
from megatron_ds.parallel.weight_grad import WeightGradStore, allow_deferral
from megatron_ds.pipeline.p2p import ACTIVATION, GRADIENT, PipelineP2P
from megatron_ds.progress import print_rank0


class InterleavedPipeline:
    """This rank's executor; ``activation_specs``: (shape, dtype) of what crosses a stage boundary."""

    def __init__(self, engine, ps, *, micro_batches: int, activation_specs: list, loss_fn, schedule=None,
                 scatter_gather: bool = False):
        """``schedule``: this rank's steps (default: the (interleaved) 1F1B of ``pipeline_schedule``);
        ``scatter_gather``: each TP rank sends 1/TP of what crosses a stage (``PipelineP2P``)."""
        self.engine = engine
        self.model = engine.module  # ModelChunks
        self.ps = ps
        self.pp, self.v, self.m = ps.pp_size, self.model.v, micro_batches
        self.num_stages = self.pp * self.v
        self.activation_specs = activation_specs
        self.loss_fn = loss_fn
        self.schedule = schedule or pipeline_schedule(self.pp, ps.pp_rank, micro_batches, self.v)
        self.weight_grads = WeightGradStore()  # zero bubble: the input backwards' deferred weight passes
        allow_deferral(any(step.kind == WEIGHT for step in self.schedule))
        self._deferred = deque()  # their micro-batches, oldest first (checked against the schedule)
        self.eval_schedule = forward_only_schedule(micro_batches, self.v, self.pp)
        self.p2p = PipelineP2P(ps, num_virtual_stages=self.num_stages, micro_batches=micro_batches,
                               scatter_gather=scatter_gather)
        self._load_dir = None
        ds_compat.use_layer_file_checkpoints(engine, self._load_layer_files)

    def __getattr__(self, name):  # only for names this object does not have: the engine's
        return getattr(self.__dict__["engine"], name)

    # --- schedule -------------------------------------------------------------------------------
    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.ps.pp_rank

    def _read(self, data_iter) -> list | None:
        """All micro-batches of the step on the ranks that read data (first and last rank)."""
        if not (self.ps.is_first_stage or self.ps.is_last_stage):
            return None
        dev = self.engine.device
        return [tuple(tuple(t.to(dev) for t in part) for part in next(data_iter)) for _ in range(self.m)]

    def _forward(self, step, batches, saved, losses, train: bool) -> None:
        c, j = step.chunk, step.microbatch
        stage = self._stage(c)
        if stage == 0:
            x = batches[j][0]
        else:
            received = self.p2p.recv(self.activation_specs, kind=ACTIVATION, stage=stage - 1, microbatch=j,
                                     device=self.engine.device)
            for t in received:
                t.requires_grad_(train and t.is_floating_point())
            x = received[0] if len(received) == 1 else tuple(received)
        out = self.engine(x, chunk=c)
        if stage == self.num_stages - 1:
            out = self.loss_fn(out, batches[j][1])
            losses.append(out.detach().float())
        else:
            self.p2p.send([t.detach() for t in _as_tuple(out)], kind=ACTIVATION, stage=stage, microbatch=j)
        if train:
            saved[c].append((j, x, out))

    def _backward(self, step, saved) -> None:
        c, j = step.chunk, step.microbatch
        stage = self._stage(c)
        saved_j, x, out = saved[c].popleft()
        assert saved_j == j, f"chunk {c}: backward of micro-batch {j} but {saved_j} is the oldest in flight"
        if stage == self.num_stages - 1:
            self.engine.backward(out)
        else:
            outputs = [t for t in _as_tuple(out) if t.is_floating_point()]
            specs = [s for s in self.activation_specs if s[1].is_floating_point]
            grads = self.p2p.recv(specs, kind=GRADIENT, stage=stage + 1, microbatch=j, device=self.engine.device)
            scale = ds_compat.backward_loss_scale(self.engine)
            surrogate = sum(torch.sum(o.float() * g.float()) for o, g in zip(outputs, grads)) / scale
            self.engine.backward(surrogate, scale_wrt_gas=False)
        if stage > 0:
            inputs = [t for t in _as_tuple(x) if t.is_floating_point()]
            self.p2p.send([t.grad for t in inputs], kind=GRADIENT, stage=stage, microbatch=j)

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One optimizer step over the schedule; returns the mean loss (over micro-batches and
        data parallel ranks) on every rank, as DeepSpeed's ``PipelineEngine.train_batch``."""
        self.engine.train()
        batches = self._read(data_iter)
        saved, losses = [deque() for _ in range(self.v)], []
        self.engine.set_gradient_accumulation_boundary(False)
        for step in self.schedule:
            if step.kind == FORWARD:
                self._forward(step, batches, saved, losses, train=True)
            elif step.kind == BACKWARD:
                self._backward(step, saved)
            elif step.kind == INPUT_BACKWARD:
                with self.weight_grads.deferring():
                    self._backward(step, saved)
                self._deferred.append(step.microbatch)
            else:
                self._weight_pass(step)
        self.p2p.wait_sends()
        self._reduce_tied_grads()
        self.engine.set_gradient_accumulation_boundary(True)
        self.engine.allreduce_gradients()
        self.engine.step()
        return self._mean_loss(losses)

    def _weight_pass(self, step) -> None:
        oldest = self._deferred.popleft()
        assert oldest == step.microbatch, f"weight pass of micro-batch {step.microbatch} but {oldest} is the oldest"
        with ds_compat.outside_backward_gradients(self.engine):
            self.weight_grads.pop()

    @torch.no_grad()
    def eval_batch(self, data_iter, reduce_output: str = "avg", bcast_loss: bool = True,
                   num_micro_batches: int | None = None) -> torch.Tensor:
        """Forward-only over the schedule's forward order; the mean loss on every rank.
        ``num_micro_batches`` (PipelineEngine's argument) must be the schedule's: the layout refuses
        batch-size ramp-ups with interleaving, so the count never changes."""
        if num_micro_batches is not None and num_micro_batches != self.m:
            raise ValueError(f"the interleaved schedule runs {self.m} micro-batches per batch, "
                             f"not {num_micro_batches}")
        self.engine.eval()
        batches = self._read(data_iter)
        losses = []
        for step in self.eval_schedule:
            self._forward(step, batches, None, losses, train=False)
        self.p2p.wait_sends()
        self.engine.train()
        return self._mean_loss(losses)

    def _reduce_tied_grads(self) -> None:
        weight = self.model.tied_weight
        if self.model.tie_group is None:
            return
        grad = ds_compat.accumulated_grad(self.engine, weight)
        if grad is None:  # keep the collective matched: the peer reduces its gradient
            grad = torch.zeros_like(weight)
        dist.all_reduce(grad, group=self.model.tie_group)

    def _mean_loss(self, losses) -> torch.Tensor:
        """Mean over micro-batches and data parallel ranks, broadcast from the last pipeline rank."""
        total = torch.zeros((), dtype=torch.float32, device=self.engine.device)
        if losses:
            total = torch.stack(losses).mean()
            dist.all_reduce(total, group=self.ps.dp_group)
            total /= self.ps.dp_size
        last = self.ps.topology.get_rank(pipe=self.pp - 1, data=self.ps.dp_rank, model=self.ps.tp_rank)
        dist.broadcast(total, src=last, group=self.ps.pp_group)
        return total

    # --- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, **kwargs):
        """DeepSpeed's checkpoint (optimizer, client state; no module weights in ``mp_rank_*``)
        plus per-layer files with global layer indices, written by data parallel rank 0 as
        ``PipelineModule.save_state_dict`` writes them."""
        path = os.path.join(save_dir, str(tag))
        if self.ps.dp_rank == 0:
            os.makedirs(path, exist_ok=True)
            for name, module in self.model.layer_files(self.ps.tp_rank):
                # clones: a parameter may be a view into an optimizer's flat buffer, which torch.save
                # would write whole (DeepSpeed's PipelineModule clones for the same reason)
                state = {k: v.detach().clone() for k, v in module.state_dict().items()}
                ds_compat.checkpoint_engine(self.engine).save(state, os.path.join(path, name))
        return self.engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {},
                                           save_latest=save_latest, **kwargs)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        self._load_dir = os.path.join(load_dir, str(tag))
        try:
            return self.engine.load_checkpoint(load_dir, tag=tag, **kwargs)
        finally:
            self._load_dir = None

    def _load_layer_files(self, strict: bool) -> None:
        for name, module in self.model.layer_files(self.ps.tp_rank):
            path = os.path.join(self._load_dir, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"{path} is missing: the checkpoint holds no weights for this layer")
            module.load_state_dict(ds_compat.checkpoint_engine(self.engine).load(path, map_location=self.engine.device),
                                   strict=strict)
        self.model.sync_tied_weights()


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def activation_specs(layout, *, reset_attention_mask: bool, dtype: torch.dtype) -> list:
    """(shape, dtype) of each tensor crossing a stage boundary: the hidden state ``[s(/cp)(/tp), b, h]`` (a
    context parallel rank's two chunks, split over TP under sequence parallelism), plus the whole sequence's
    ``[b, s]`` int64 document ids with ``--reset-attention-mask`` (every CP rank's attention masks by them), plus
    in an MoE model the ``[1]`` fp32 sum of the auxiliary losses of the layers so far (``model/transformer.py``
    ``pack_activation``): it reaches the loss on the last stage, and its gradient comes back with the hidden
    state's, as on DeepSpeed's pipeline engine."""
    m = layout.model
    seq = m.seq_length // layout.cp
    seq = seq // layout.tp if layout.sequence_parallel else seq
    specs = [((seq, layout.micro_batch_size, m.hidden_size), dtype)]
    if reset_attention_mask:
        specs.append(((layout.micro_batch_size, m.seq_length), torch.int64))
    if is_moe(m):
        specs.append(((1,), torch.float32))
    return specs


def wrap_engine(engine, run, ps) -> InterleavedPipeline:
    """The executor around DeepSpeed's plain engine holding a family's ``ModelChunks`` (``pipeline/chunks.py``)."""
    layout = run.layout
    # --fp32-residual-connection: the hidden state between stages is the fp32 residual stream
    # (Megatron's p2p_communication receives into fp32 buffers then too)
    hidden_dtype = torch.float32 if layout.model.fp32_residual_connection else PRECISION_DTYPES[layout.precision]
    specs = activation_specs(layout, reset_attention_mask=run.data.reset_attention_mask, dtype=hidden_dtype)
    if layout.precision == "bf16" and not ds_compat.accumulates_grads_in_fp32(engine):
        print_rank0("WARNING: DeepSpeed's plain engine accumulates --bf16 gradients over micro-batches in bf16 "
                    "under ZeRO 0; for fp32 accumulation (what its pipeline engine does) use --zero-stage 1 with "
                    "\"data_types\": {\"grad_accum_dtype\": \"fp32\"} (ds_configs/zero1_bf16.json)")
    schedule = None  # (interleaved) 1F1B
    if layout.zbh1 is not None:
        schedule = zbh1_schedule(layout.pp, ps.pp_rank, layout.grad_accum_steps, exact=layout.zbh1 == "exact")
    return InterleavedPipeline(engine, ps, micro_batches=layout.grad_accum_steps, activation_specs=specs,
                               loss_fn=engine.module.loss_fn, schedule=schedule,
                               scatter_gather=layout.scatter_gather_p2p)
