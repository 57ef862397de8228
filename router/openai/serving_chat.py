"""/v1/chat/completions: messages in (through the model's chat template), `chat.completion` out.

The endpoint's hooks of `OpenAIServing` (router/openai/serving.py): one prompt, the messages
rendered by the tokenizer's chat template; max_tokens, when not asked, as much as the context and
the largest KV cache leave (as vLLM); chat logprobs (`logprobs: true, top_logprobs: N`); the
response, and chunks that open with the assistant's role and always carry `finish_reason`.
"""

from __future__ import annotations

import json

from cluster.tokenizer import encode_chat
from router.openai.logprobs import chat_logprobs
from router.openai.protocol import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
                                    ChatCompletionResponse, ChatResponseMessage, DeltaMessage)
from router.openai.serving import ChunkFormat, OpenAIServing
from router.openai.streaming import event


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def prompts(self, body: ChatCompletionRequest) -> list:
        return [body.messages]

    def encode(self, messages) -> list[int]:
        return encode_chat(self.gw.tokenizer, [m.as_template_dict() for m in messages])

    def max_tokens(self, body: ChatCompletionRequest, ids) -> int:
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # like vLLM: as much as the context (and the KV cache) leaves
            cfg = self.gw.cfg
            room = min(cfg.max_model_len, self.gw.kv_capacity_tokens() or cfg.max_model_len) - len(ids)
            max_tokens = max(1, room)
        return max_tokens

    def num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def response(self, rid, body, choices, results, usage):
        out = []
        for c, (text, positions) in zip(choices, results):
            logprobs = chat_logprobs(positions, body.num_logprobs) if body.num_logprobs is not None else None
            out.append(ChatChoice(index=c.index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                                  finish_reason=c.gen.finish_reason))
        return ChatCompletionResponse(id=rid, model=body.model, usage=usage, choices=out)

    def chunks(self, rid, body, created):
        return _ChatChunks(rid, body, created)


class _ChatChunks(ChunkFormat):
    def __init__(self, rid: str, body: ChatCompletionRequest, created: int):
        self.rid, self.body, self.created = rid, body, created

    def _chunk(self, index: int, delta: DeltaMessage, finish: str | None, positions=()) -> str:
        logprobs = None
        if self.body.num_logprobs is not None and positions:
            logprobs = chat_logprobs(positions, self.body.num_logprobs)
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model,
                                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                         finish_reason=finish)])
        d = c.model_dump(exclude_none=True)
        d["choices"][0]["finish_reason"] = finish  # always present, null until the end
        if self.body.include_usage:
            d["usage"] = None
        return event(json.dumps(d, separators=(",", ":")))

    def opening(self, index):
        return [self._chunk(index, DeltaMessage(role="assistant", content=""), None)]

    def piece(self, index, text, finish, positions):
        return self._chunk(index, DeltaMessage(content=text) if text else DeltaMessage(), finish, positions)

    def usage(self, usage):
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return event(c.model_dump_json())
