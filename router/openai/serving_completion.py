"""/v1/completions: one or more prompts (text or token ids) in, `text_completion` objects out.

The endpoint's hooks of `OpenAIServing` (router/openai/serving.py): the prompts as given, max_tokens
the model's max_new_tokens (generation_config.json) or `default_max_tokens` (16, OpenAI's default)
unless asked, legacy logprobs (`logprobs: N`) and echo, vLLM's prompt_logprobs (non-streamed), and
the response and chunk shapes. A chunk is built by hand around its fixed parts: it is the hot path,
one event per token per request (per delta from the decode worker, even when its text is held back).
"""

from __future__ import annotations

import json

from cluster.text.tokenizer import encode_prompt
from router.openai.logprobs import CompletionLogprobsBuilder, prompt_logprobs_map
from router.openai.protocol import CompletionRequest
from router.openai.protocol_responses import CompletionChoice, CompletionResponse
from router.openai.serving import ChunkFormat, OpenAIServing
from router.openai.streaming import event


class OpenAIServingCompletion(OpenAIServing):
    id_prefix = "cmpl"

    def prompts(self, body: CompletionRequest) -> list:
        return body.prompts()

    def encode(self, prompt, opts) -> list[int]:
        return encode_prompt(self.gw.tokenizer, prompt)

    def max_tokens(self, body: CompletionRequest, ids) -> int:
        if body.max_tokens is not None:
            return body.max_tokens
        cfg = self.gw.cfg  # the model's max_new_tokens (--generation-config), else OpenAI's 16
        return cfg.sampling_defaults.max_tokens or cfg.default_max_tokens

    def num_logprobs(self, body: CompletionRequest) -> int | None:
        return body.logprobs

    def echo(self, body: CompletionRequest) -> bool:
        return bool(body.echo)

    def needs_tokenizer(self, body: CompletionRequest, echo: bool) -> bool:
        return echo or bool(body.bad_words) or any(isinstance(p, str) for p in body.prompts())

    def response(self, rid, body, opts, choices, results, usage):
        out = []
        for c, (text, positions) in zip(choices, results):
            logprobs = CompletionLogprobsBuilder(body.logprobs).add(positions) if body.logprobs is not None else None
            prompt_lps = None
            if body.prompt_logprobs is not None:
                prompt_lps = prompt_logprobs_map(c.prompt_logprobs(), body.prompt_logprobs)
            out.append(CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.gen.finish_reason,
                                        prompt_logprobs=prompt_lps))
        return CompletionResponse(id=rid, model=body.model, usage=usage, choices=out)

    def chunks(self, rid, body, opts, created):
        return _CompletionChunks(rid, body, created)


class _CompletionChunks(ChunkFormat):
    def __init__(self, rid: str, body: CompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created
        # Hot path (one event per token per request): the chunk's fixed parts are encoded once and
        # only index, text and finish_reason are serialised per event (~1 us instead of ~12 through pydantic).
        self.head = (f'data: {{"id":{json.dumps(rid)},"object":"text_completion","created":{created},'
                     f'"model":{json.dumps(body.model)},"choices":[{{"index":')
        self.tail = ',"usage":null}\n\n' if body.include_usage else '}\n\n'
        self.logprobs: dict[int, CompletionLogprobsBuilder] = {}  # per choice (text offsets go on)

    def piece(self, index, text, finish, positions, usage=None):
        lp = "null"
        if self.body.logprobs is not None:
            builder = self.logprobs.get(index)
            if builder is None:
                builder = self.logprobs[index] = CompletionLogprobsBuilder(self.body.logprobs)
            lp = builder.add(positions).model_dump_json()
        tail = self.tail if usage is None else (
            f',"usage":{{"prompt_tokens":{usage.prompt_tokens},"completion_tokens":{usage.completion_tokens},'
            f'"total_tokens":{usage.total_tokens}}}}}\n\n')
        return (f'{self.head}{index},"text":{json.dumps(text)},"logprobs":{lp},'
                f'"finish_reason":{json.dumps(finish)}}}]{tail}')

    def usage(self, usage):
        chunk = CompletionResponse(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return event(chunk.model_dump_json())
