"""SmolLM2-135M-Instruct (GGUF) served disaggregated (prefill worker -> KV transfer -> decode worker)
over real HTTP, against transformers loading the same file: greedy completions and chats equal token
for token (streamed too), a chat stops at <|im_end|>, JSON-schema output validates, a forced tool call
parses, prompt logprobs equal, and the log-likelihood choices of the project's own multiple-choice
task (benchmarks/real_model_task/facts.jsonl, lm-eval's request shape) are transformers' choices."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?"]
FACTS = Path(__file__).resolve().parents[2] / "benchmarks" / "real_model_task" / "facts.jsonl"
ATOL = 2e-4  # float32 on both sides; the kernels sum in another order


@pytest.fixture(scope="module")
def client(smollm2_cluster):
    return openai.OpenAI(base_url=f"{smollm2_cluster.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat_ids(tok, question: str) -> list[int]:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def test_greedy_completions_equal_transformers(client, hf_smollm2, hf_greedy):
    tok = hf_smollm2[1]
    for prompt in PROMPTS:
        want = hf_greedy(tok(prompt).input_ids, 24)
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == tok.decode(want), prompt
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True) if c.choices)
        assert streamed == got.choices[0].text


def test_greedy_chats_equal_transformers_and_stop_at_im_end(client, hf_smollm2, hf_greedy):
    tok = hf_smollm2[1]
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    stopped = 0
    for q in QUESTIONS:
        want = hf_greedy(_chat_ids(tok, q), 48)
        ended = want[-1] == eos  # transformers ended the answer at EOS (else at max_new_tokens)
        stopped += ended
        got = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                             max_tokens=48, temperature=0)
        choice = got.choices[0]
        assert choice.message.content == tok.decode(want[:-1] if ended else want), q
        assert (choice.finish_reason, got.usage.completion_tokens) == ("stop" if ended else "length", len(want))
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=48, temperature=0, stream=True)
            if c.choices)
        assert streamed == choice.message.content
        if q == QUESTIONS[0]:
            assert "Paris" in choice.message.content
    assert stopped >= 1, "no answer ended at <|im_end|> within 48 tokens"


def test_json_schema_output_validates(client):
    jsonschema = pytest.importorskip("jsonschema")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                              "is_capital": {"type": "boolean"}},
              "required": ["city", "is_capital"], "additionalProperties": False}
    got = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give the largest city of Japan as JSON, and whether it is the capital."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(got.choices[0].message.content), schema)


def test_forced_tool_call(client):
    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    got = client.chat.completions.create(
        model=MODEL, max_tokens=120, temperature=0, tools=[tool],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    calls = got.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


def test_prompt_logprobs_equal_transformers(client, hf_smollm2, hf_log_softmax):
    tok = hf_smollm2[1]
    ids = tok("The quick brown fox jumps over the lazy dog. Paris is the capital of").input_ids
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = got.choices[0].logprobs
    ref = hf_log_softmax(ids)
    assert lp.token_logprobs[0] is None
    for j in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[j], ref[j - 1, ids[j]].item(), abs_tol=ATOL), j


def _loglikelihood(client, ctx: list[int], cont: list[int]) -> float:
    """lm-eval's local-completions log-likelihood request: the continuation's summed logprobs."""
    got = client.completions.create(model=MODEL, prompt=ctx + cont, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    return sum(got.choices[0].logprobs.token_logprobs[len(ctx):])


def test_multiple_choice_loglikelihood_chooses_as_transformers(client, hf_smollm2, hf_log_softmax):
    """The project's own task, scored as lm-eval scores it (context, then " " + choice), by the server
    and by transformers: the same choice on every item (lm-eval itself: benchmarks/real_model_cpu.py)."""
    tok = hf_smollm2[1]
    items = [json.loads(line) for line in FACTS.read_text().splitlines()]
    agree = correct = 0
    for item in items:
        ctx = tok(item["question"]).input_ids
        ours, theirs = [], []
        for choice in item["choices"]:
            cont = tok(" " + choice, add_special_tokens=False).input_ids
            ours.append(_loglikelihood(client, ctx, cont))
            lsm = hf_log_softmax(ctx + cont)
            theirs.append(sum(lsm[len(ctx) + j - 1, t].item() for j, t in enumerate(cont)))
            assert math.isclose(ours[-1], theirs[-1], abs_tol=1e-3)
        pick = max(range(len(ours)), key=ours.__getitem__)
        agree += pick == max(range(len(theirs)), key=theirs.__getitem__)
        correct += pick == item["answer"]
    assert agree == len(items)
    assert correct >= len(items) // 2, "a trained model knows most of these facts"
