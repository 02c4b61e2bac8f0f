"""Sequence-length warm-up: DeepSpeed's legacy ``curriculum_learning`` block as Megatron-DeepSpeed applies it.

The block (``"curriculum_type": "seqlen"``) says how many tokens of each training sample are used at
optimizer step n (1-based): Megatron-DeepSpeed's pipeline path asks its own
``deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`` for
``update_difficulty(iteration + 1)`` before each step and truncates the micro-batches
(megatron/training.py ``train``, pretrain_gpt.py ``get_batch_pipe``); with ``--no-pipeline-parallel``
DeepSpeed's engine asks the same scheduler for ``global_steps + 1`` in every training forward and passes
``curriculum_seqlen`` to the model, which truncates (deepspeed/runtime/engine.py ``forward`` before 0.19,
megatron/model/gpt_model.py). Both: evaluation at the full length, consumed tokens += samples x length.

DeepSpeed >= 0.19 refuses the legacy block, so it is parsed here and taken out of the JSON the engine
gets. The schedule (``seqlen_at``) is the scheduler's ``get_difficulty`` with its "only while below
max_difficulty" update rule, as a pure function of the step.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_ds.errors import ConfigError

_TYPES = ("fixed_linear", "fixed_root", "fixed_discrete")


@dataclass(frozen=True)
class SeqlenCurriculum:
    """The parsed block; ``seqlen_at(step)`` is the number of tokens per sample at optimizer step ``step``."""
    schedule_type: str
    min_difficulty: int
    max_difficulty: int
    seq_length: int  # --seq-length: evaluation's length, and the longest allowed
    total_curriculum_step: int = 0  # fixed_linear / fixed_root
    difficulty_step: int = 1  # fixed_linear / fixed_root
    root_degree: float = 1.0  # fixed_root (fixed_linear is degree 1)
    difficulties: tuple[int, ...] = ()  # fixed_discrete
    max_steps: tuple[int, ...] = ()  # fixed_discrete: the last step of each difficulty but the last

    def _difficulty(self, step: int) -> int:
        """CurriculumScheduler.get_difficulty(step)."""
        if self.schedule_type == "fixed_discrete":
            for difficulty, last in zip(self.difficulties, self.max_steps):
                if step <= last:
                    return difficulty
            return self.difficulties[-1]
        fraction = (float(step) / self.total_curriculum_step) ** (1.0 / self.root_degree)
        value = math.floor(fraction * (self.max_difficulty - self.min_difficulty) + self.min_difficulty)
        value -= value % self.difficulty_step
        return min(value, self.max_difficulty)

    def _first_step_at_max(self) -> int | None:
        """The first step whose difficulty reaches max_difficulty: the scheduler stops updating there."""
        if self.min_difficulty >= self.max_difficulty:
            return 0
        if self.schedule_type != "fixed_discrete":
            return None  # monotone: staying at the maximum needs no memory
        first = 1
        for difficulty, last in zip(self.difficulties, self.max_steps + (None,)):
            if difficulty >= self.max_difficulty:
                return first
            first = (last or 0) + 1
        return None

    def seqlen_at(self, step: int) -> int:
        """Tokens per sample at step ``step``: the scheduler's current difficulty after
        update_difficulty(1 .. step) from a fresh start (never above --seq-length: parse_curriculum checks)."""
        frozen = self._first_step_at_max()
        if frozen == 0:
            return self.min_difficulty
        return self._difficulty(frozen if frozen is not None and step >= frozen else step)

    def describe(self) -> str:
        if self.schedule_type == "fixed_discrete":
            span = f"lengths {list(self.difficulties)} up to steps {list(self.max_steps)}"
        else:
            root = f", root degree {self.root_degree:g}" if self.schedule_type == "fixed_root" else ""
            span = (f"{self.min_difficulty} -> {self.max_difficulty} over {self.total_curriculum_step:,} steps "
                    f"in multiples of {self.difficulty_step}{root}")
        return f"sequence-length warm-up ({self.schedule_type}): {span}; evaluation at {self.seq_length}"


def _number(block: dict, key: str, where: str, kind=int):
    if key not in block:
        raise ConfigError(f"{where} needs \"{key}\" (as DeepSpeed's CurriculumScheduler)")
    value = block[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
            or (kind is int and value != int(value)):
        raise ConfigError(f"{where}: \"{key}\" = {value!r} must be a positive {kind.__name__}")
    return kind(value)


def _schedule(block: dict, kind: str, where: str) -> dict:
    sc = block.get("schedule_config")
    if not isinstance(sc, dict):
        raise ConfigError(f"{where} needs a \"schedule_config\" object for \"{kind}\"")
    at = f"{where}.schedule_config"
    if kind == "fixed_discrete":
        diffs, steps = sc.get("difficulty"), sc.get("max_step")
        if not (isinstance(diffs, list) and isinstance(steps, list) and diffs and len(diffs) == len(steps) + 1):
            raise ConfigError(f"{at}: \"difficulty\" must be a list one longer than \"max_step\" "
                              f"(got {diffs!r} and {steps!r})")
        return {"difficulties": tuple(int(d) for d in diffs), "max_steps": tuple(int(s) for s in steps)}
    out = {"total_curriculum_step": _number(sc, "total_curriculum_step", at),
           "difficulty_step": _number(sc, "difficulty_step", at)}
    if kind == "fixed_root":
        out["root_degree"] = _number(sc, "root_degree", at, float)
    return out


def parse_curriculum(block: dict, seq_length: int, where: str = 'the DeepSpeed JSON\'s "curriculum_learning"'
                     ) -> SeqlenCurriculum:
    """The enabled legacy block as a SeqlenCurriculum; a ConfigError naming the key for anything else."""
    kind = block.get("schedule_type")
    if block.get("curriculum_type", "seqlen") != "seqlen":
        raise ConfigError(f"{where}: \"curriculum_type\" {block['curriculum_type']!r} is not supported; only "
                          f"\"seqlen\" (sequence-length warm-up) is")
    if kind not in _TYPES:
        raise ConfigError(f"{where}: \"schedule_type\" {kind!r} is not supported; use one of {', '.join(_TYPES)} "
                          f"(\"custom\" needs a Python schedule function megatron_ds has no way to take)")
    cl = SeqlenCurriculum(schedule_type=kind, min_difficulty=_number(block, "min_difficulty", where),
                          max_difficulty=_number(block, "max_difficulty", where), seq_length=seq_length,
                          **_schedule(block, kind, where))
    top = max(cl.difficulties) if kind == "fixed_discrete" else cl.max_difficulty
    if top > seq_length:
        # Megatron-DeepSpeed would count such lengths as consumed tokens without training them
        raise ConfigError(f"{where}: a length of {top} is above --seq-length {seq_length}; the warm-up ends at "
                          f"the sample length (set \"max_difficulty\" to {seq_length})")
    if kind != "fixed_discrete" and cl.min_difficulty % cl.difficulty_step:
        # DeepSpeed 0.19 raises such a first length to a multiple of difficulty_step; the releases
        # Megatron-DeepSpeed ran with round it down below min_difficulty: refuse rather than pick one
        raise ConfigError(f"{where}: \"min_difficulty\" {cl.min_difficulty} is not a multiple of "
                          f"\"difficulty_step\" {cl.difficulty_step} (DeepSpeed releases disagree on the first "
                          f"lengths); use a multiple")
    return cl


def legacy_curriculum(template: dict | None, flag: bool, seq_length: int) -> SeqlenCurriculum | None:
    """The run's sequence-length warm-up, or None. As megatron/training.py ``pretrain``: the JSON block's
    "enabled" decides when it has one, else --curriculum-learning-legacy (which then needs the block)."""
    block = (template or {}).get("curriculum_learning")
    enabled = block.get("enabled", flag) if isinstance(block, dict) else flag
    if not enabled:
        return None
    if not isinstance(block, dict):
        raise ConfigError("--curriculum-learning-legacy needs a \"curriculum_learning\" block in the DeepSpeed JSON "
                          "(curriculum_type, min_difficulty, max_difficulty, schedule_type, schedule_config)")
    return parse_curriculum(block, seq_length)
