"""lm-eval on the project's own multiple-choice task (benchmarks/real_model_task/facts.jsonl), timed as a
user's lm-eval run is: the backend built (`hf`: the model loaded from the GGUF file; `local-completions`:
the tokenizer loaded, the server already up), then the task evaluated. Each question is scored with
" " + each choice, as lm-eval's multiple-choice tasks are.

    python -m benchmarks.real_model_lm_eval BACKEND MODEL_ARGS_JSON

prints one run (`run()`'s dict) as JSON: tests/real_model/test_lm_eval.py runs the `hf` backend so, in a
process of its own as a user's run is (the test process also runs the cluster's router).
"""

from __future__ import annotations

import json
import sys
import time

from benchmarks.real_model_requests import TASK

TASK_NAME = "pdserve_facts"


def task_config() -> dict:
    return {"task": TASK_NAME, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(TASK)}},
            "test_split": "test", "output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "answer", "target_delimiter": " ",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}


def loglikelihoods(samples: list[dict]) -> list[list[float]]:
    """Per item (in the task's order), the log-likelihood lm-eval got for each choice (samples as its
    log_samples writes them)."""
    return [[float(r[0]) for r in x["filtered_resps"]] for x in sorted(samples, key=lambda x: x["doc_id"])]


def picks(samples: list[dict]) -> list[int]:
    """The choice lm-eval scored highest on each item."""
    return [max(range(len(lls)), key=lls.__getitem__) for lls in loglikelihoods(samples)]


def run(backend: str, model_args: dict) -> dict:
    """One run through lm-eval's Python API: seconds to build the backend and to evaluate, the
    per-choice log-likelihoods, the picks and the accuracy."""
    import lm_eval
    from lm_eval.api.registry import get_model
    from lm_eval.tasks import TaskManager

    # include_defaults=False: indexing lm-eval's ~15k bundled task configs takes ~40 s on two cores.
    tasks = TaskManager(include_defaults=False)
    t0 = time.perf_counter()
    lm = get_model(backend).create_from_arg_obj(model_args, {"batch_size": 1, "device": "cpu"})
    built = time.perf_counter()
    out = lm_eval.simple_evaluate(model=lm, tasks=[task_config()], task_manager=tasks, batch_size=1, device="cpu",
                                  log_samples=True, bootstrap_iters=0)
    done = time.perf_counter()
    samples = out["samples"][TASK_NAME]
    return {"backend": backend, "build_s": built - t0, "evaluate_s": done - built, "wall_s": done - t0,
            "acc": out["results"][TASK_NAME]["acc,none"], "requests": sum(len(x["filtered_resps"]) for x in samples),
            "loglikelihoods": loglikelihoods(samples), "picks": picks(samples)}


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], json.loads(sys.argv[2]))))
