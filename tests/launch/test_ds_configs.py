"""ds_configs/ templates: valid JSON, the split of duties the README promises, and accepted by
DeepSpeed's own config parser once the command line's values are filled in."""
import json
import re

import pytest

from tests.launch.helpers import REPO
from megatron_ds.families.gpt.gpt_family import GPT

CONFIGS = REPO / "ds_configs"
TEMPLATES = sorted(CONFIGS.glob("*.json"))
NAME = re.compile(r"^zero([0-3])_(fp16|bf16)\.json$")
# Owned by the command line (--micro-batch-size, --global-batch-size, --lr, ...): never in a
# template.
CLI_OWNED = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
             "optimizer", "scheduler", "gradient_clipping"}


def load_strict(path):
    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        assert len(keys) == len(set(keys)), f"{path.name}: duplicate keys {keys}"
        return dict(pairs)
    return json.loads(path.read_text(), object_pairs_hook=no_duplicates)


def fill_from_cli(path, precision, micro_batch=2, global_batch=8):
    """The DeepSpeed JSON megatron_ds really builds from a template and a command line."""
    from megatron_ds.config import parse_args, resolve

    stage = int(NAME.match(path.name).group(1))
    argv = (f"--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --train-iters 1 --lr 1e-3 "
            f"--micro-batch-size {micro_batch} --global-batch-size {global_batch} --deepspeed_config {path}").split()
    argv += [f"--{precision}"] if precision != "fp32" else []
    argv += ["--no-pipeline-parallel"] if stage >= 2 else []  # ZeRO 2/3 need the plain engine
    cfg, _ = parse_args(argv)
    # resolve reads the template from --deepspeed_config
    return resolve(cfg, world_size=1, vocab_size=100, device_type="cuda", family=GPT).layout.ds_config


def test_every_stage_and_precision_is_shipped():
    names = {p.name for p in TEMPLATES}
    assert names == {f"zero{s}_{p}.json" for s in range(4) for p in ("fp16", "bf16")}


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
def test_template_contents(path):
    stage, precision = NAME.match(path.name).groups()
    config = load_strict(path)
    assert config["zero_optimization"]["stage"] == int(stage)
    assert config[precision]["enabled"] == "auto"
    other = "bf16" if precision == "fp16" else "fp16"
    assert other not in config
    assert not CLI_OWNED & config.keys()
    assert isinstance(config["steps_per_print"], int) and config["steps_per_print"] > 0
    assert config["wall_clock_breakdown"] is False
    if precision == "fp16":  # dynamic loss scaling knobs live in the JSON
        assert config["fp16"]["loss_scale"] == 0
        for knob in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            assert knob in config["fp16"]


@pytest.mark.parametrize("path", TEMPLATES, ids=lambda p: p.name)
@pytest.mark.parametrize("precision", ["fp16", "bf16", "fp32"])
def test_deepspeed_accepts_filled_template(path, precision):
    """DeepSpeed validates zero_optimization etc. with pydantic and rejects unknown keys."""
    from deepspeed.runtime.config import DeepSpeedConfig  # heavy import: only in this test
    stage = NAME.match(path.name).group(1)
    config = DeepSpeedConfig(fill_from_cli(path, precision))
    assert config.zero_optimization_stage == int(stage)
    assert config.train_batch_size == 8 and config.gradient_accumulation_steps == 4  # 8 / (micro 2 x DP 1)
    # the command line's precision wins whatever block the template carries
    assert config.float16_config.enabled == (precision == "fp16")
    assert config.bfloat16_config.enabled == (precision == "bf16")


def test_readme_lists_every_template():
    readme = (CONFIGS / "README.md").read_text()
    for path in TEMPLATES:
        assert path.name in readme
    assert '"auto"' in readme
