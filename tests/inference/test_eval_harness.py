"""lm-evaluation-harness on a checkpoint (tools/eval_harness.py) gives the scores lm-eval's own ``hf`` model
gives on the checkpoint's Hugging Face export, on local task files, offline:

- a multiple-choice task (loglikelihood requests: acc and acc_norm, and every choice's log-likelihood),
  3-shot (lm-eval's seeded sampler: the same prompts on every rank), so that some contexts are longer
  than the model's 48 positions and are cut on the left,
- a perplexity task (loglikelihood_rolling; one document longer than the model's 48 positions, so
  the rolling windows are exercised): word and byte perplexity, bits per byte,
- a generation task (generate_until, greedy, stopped at a newline): exact match and the texts,

in one process and at tensor parallel 2 (there with Megatron-DeepSpeed's tasks/eval_harness flag
names and Megatron's model flags, which agree with the checkpoint). The model: a GPT-2 built by transformers with random weights
(init std 0.2, so greedy choices are no near-ties) and a byte-level BPE the test trains, imported
with tools/checkpoint/from_hf.py (tests/inference/common.py) and exported again with to_hf.py (the
export lm-eval's ``hf`` reads).
Tolerance: both fp32 on the same weights, different kernels: 1e-5 relative on log-likelihoods.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from tests.distributed import run_distributed
from tests.inference.common import CORPUS_WORDS, imported_gpt2, sentence

transformers = pytest.importorskip("transformers")
pytest.importorskip("lm_eval")
pytest.importorskip("accelerate")  # lm-eval's hf model imports it

TASKS = "tiny_choice,tiny_ppl,tiny_gen"


def _write_jsonl(path, rows) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_tasks(folder) -> None:
    """Three task YAMLs over local JSONL files (lm-eval's packaged ``json`` loader: no hub)."""
    choice = [{"question": sentence(i, 5), "choices": [" " + sentence(i + 1, 2), " " + sentence(i + 3, 3),
                                                        " " + CORPUS_WORDS[i % len(CORPUS_WORDS)]], "answer": i % 3}
              for i in range(6)]
    ppl = [{"text": sentence(i, 6 + 4 * i)} for i in range(4)] + [{"text": sentence(9, 40)}]
    gen = [{"prompt": sentence(i, 4), "target": CORPUS_WORDS[(i * 5) % len(CORPUS_WORDS)]} for i in range(4)]
    for name, rows in (("choice", choice), ("ppl", ppl), ("gen", gen)):
        _write_jsonl(folder / f"{name}.jsonl", rows)
    common = "dataset_path: json\ntest_split: test\n"
    (folder / "tiny_choice.yaml").write_text(common + textwrap.dedent(f"""\
        task: tiny_choice
        dataset_kwargs: {{data_files: {{test: {folder / 'choice.jsonl'}}}}}
        fewshot_split: test
        num_fewshot: 3
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list: [{{metric: acc}}, {{metric: acc_norm}}]
        """))
    (folder / "tiny_ppl.yaml").write_text(common + textwrap.dedent(f"""\
        task: tiny_ppl
        dataset_kwargs: {{data_files: {{test: {folder / 'ppl.jsonl'}}}}}
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{{{text}}}}"
        metric_list: [{{metric: word_perplexity}}, {{metric: byte_perplexity}}, {{metric: bits_per_byte}}]
        """))
    (folder / "tiny_gen.yaml").write_text(common + textwrap.dedent(f"""\
        task: tiny_gen
        dataset_kwargs: {{data_files: {{test: {folder / 'gen.jsonl'}}}}}
        output_type: generate_until
        doc_to_text: "{{{{prompt}}}}"
        doc_to_target: "{{{{target}}}}"
        generation_kwargs: {{until: ["\\n"], max_gen_toks: 6, do_sample: false}}
        metric_list: [{{metric: exact_match}}]
        """))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(checkpoint, its HF export, the task folder)."""
    from megatron_ds.cli import to_hf

    root = tmp_path_factory.mktemp("lm_eval")
    ckpt = imported_gpt2(root)
    assert to_hf.main(["--load", ckpt, "--out", str(root / "export")]) == 0
    (root / "tasks").mkdir()
    write_tasks(root / "tasks")
    return ckpt, str(root / "export"), root / "tasks"


def _ours(rank, world_size, ckpt, tasks, out, names=("--tasks", "--output", "--batch-size"), extra=()):
    from megatron_ds.cli import eval_harness

    tasks_flag, output_flag, batch_flag = names
    assert eval_harness.main(["--load", ckpt, tasks_flag, TASKS, "--include-path", str(tasks), "--offline",
                                 "--no-builtin-tasks", "--log-samples", batch_flag, "3", output_flag, out,
                                 *extra]) == 0
    return json.load(open(out)) if rank == 0 else None


def _theirs(export, tasks):
    from lm_eval.evaluator import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="hf", model_args={"pretrained": export, "dtype": "float32", "device": "cpu"},
                           tasks=TASKS.split(","), batch_size=4, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks), include_defaults=False))


def _compare(ours: dict, theirs: dict) -> None:
    for task in TASKS.split(","):
        mine, ref = ours["results"][task], theirs["results"][task]
        metrics = [k for k in ref if k.endswith(",none") and not k.endswith("_stderr,none")]
        assert metrics, ref
        for k in metrics:
            assert mine[k] == pytest.approx(ref[k], rel=1e-5), (task, k)
        by_doc = {s["doc_id"]: s for s in ours["samples"][task]}
        for s in theirs["samples"][task]:
            got = by_doc[s["doc_id"]]["resps"]
            if task == "tiny_gen":
                assert got == s["resps"], s["doc"]
            else:
                # one response per request: [logprob] (rolling) or [(logprob, greedy)] (multiple choice)
                for g, r in zip(got, s["resps"], strict=True):
                    g, r = (g[0], r[0]) if task == "tiny_ppl" else (g[0][0], r[0][0])
                    assert float(g) == pytest.approx(float(r), rel=1e-5), (task, s["doc"])


def test_scores_equal_lm_evals_hf_model_on_the_export(setup, tmp_path, monkeypatch):
    ckpt, export, tasks = setup
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):  # restored afterwards (--offline sets them too)
        monkeypatch.setenv(name, "1")
    theirs = _theirs(export, tasks)
    _compare(_ours(0, 1, ckpt, tasks, str(tmp_path / "tp1.json")), theirs)
    # at TP 2, with Megatron-DeepSpeed's tasks/eval_harness names and Megatron's model flags
    megatron = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32",
                "--num-attention-heads", "4", "--max-position-embeddings", "48", "--eval_fp32"]
    [tp2, _] = run_distributed(_ours, 2, ckpt, tasks, str(tmp_path / "tp2.json"),
                               ("--task_list", "--results_path", "--micro-batch-size"), megatron, timeout=300)
    _compare(tp2, theirs)
