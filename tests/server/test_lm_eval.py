"""lm-evaluation-harness as a client: `local-completions` against our server and `hf` (transformers)
on the same tiny random float32 checkpoint, on a multiple-choice task and a generation task defined
by local files (no downloads), give the same accuracy, the same generations and per-sample
loglikelihoods within 1e-3."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install -e '.[test]')")

from servescope.engine.async_engine import AsyncEngine  # noqa: E402
from servescope.engine.llm_engine import LLMEngine  # noqa: E402
from servescope.server.app import build_app  # noqa: E402

from .server_utils import LiveServer  # noqa: E402

MC = [{"question": f"Q: {a} plus {b} is", "choices": [f" {a + b}", f" {a + b + 1}", f" {a * b + 7}"], "answer": i % 3}
      for i, (a, b) in enumerate([(1, 2), (3, 4), (10, 5), (7, 7), (2, 9), (6, 1)])]
GEN = [{"question": f"Say the word number {i}:", "answer": " yes"} for i in range(4)]


def _task_files(d) -> None:
    (d / "mc.jsonl").write_text("\n".join(json.dumps(x) for x in MC))
    (d / "gen.jsonl").write_text("\n".join(json.dumps(x) for x in GEN))
    (d / "ss_mc.yaml").write_text(f"""task: ss_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (d / "ss_gen.yaml").write_text(f"""task: ss_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 6
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
""")


def _evaluate(model: str, model_args: str, task_dir) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["ss_mc", "ss_gen"],
                                   task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                   log_samples=True,
                                   batch_size=1, random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                   fewshot_random_seed=0)


def _loglikelihoods(res: dict) -> list:
    return [[float(r[0][0]) for r in s["resps"]] for s in sorted(res["samples"]["ss_mc"], key=lambda s: s["doc_id"])]


def _generations(res: dict) -> list:
    return [s["filtered_resps"] for s in sorted(res["samples"]["ss_gen"], key=lambda s: s["doc_id"])]


def test_lm_eval_local_completions_matches_hf(tmp_path):
    from tiny_models import make_tiny_hf_model

    ckpt = make_tiny_hf_model(tmp_path, "llama_plain")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    _task_files(tasks)
    ae = AsyncEngine(LLMEngine(model=str(ckpt), num_kv_blocks=128, max_model_len=512))
    server = LiveServer(build_app(ae, model_name="tiny")).start()
    try:
        ours = _evaluate("local-completions",
                         f"base_url={server.url}/v1/completions,model=tiny,tokenizer={ckpt},"
                         "tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1",
                         tasks)
    finally:
        server.stop()
        ae.shutdown()
    ref = _evaluate("hf", f"pretrained={ckpt},dtype=float32,device=cpu", tasks)
    a, b = _loglikelihoods(ours), _loglikelihoods(ref)
    assert len(a) == len(MC) and all(len(x) == 3 for x in a)
    diff = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    assert diff <= 1e-3, (diff, a, b)
    assert ours["results"]["ss_mc"]["acc,none"] == ref["results"]["ss_mc"]["acc,none"]
    assert _generations(ours) == _generations(ref)
    assert ours["results"]["ss_gen"]["exact_match,none"] == ref["results"]["ss_gen"]["exact_match,none"]
