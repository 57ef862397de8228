"""/v1/chat/completions: messages in (through the model's chat template), `chat.completion` out.

The endpoint's hooks of `OpenAIServing` (router/openai/serving.py): one prompt, the messages (and
the request's tools) rendered by the tokenizer's chat template; max_tokens, when not asked, as much
as the context and the largest KV cache leave (as vLLM); chat logprobs (`logprobs: true,
top_logprobs: N`); vLLM's prompt_logprobs (non-streamed, top level); the response, and chunks that
open with the assistant's role and always carry `finish_reason`.

Tools (router/openai/tool_calling.py): a forced call (tool_choice "required" or named) is a
constraint the grammar engine enforces, like response_format (the two cannot be combined); a reply
that is parsed for calls comes back as `message.tool_calls` (content null beside them when there is
no text), streamed as `delta.tool_calls` fragments by each choice's own parser.
"""

from __future__ import annotations

import json

from cluster.errors import InvalidRequestError
from cluster.kv.request_limits import default_max_tokens
from cluster.text.tokenizer import encode_chat
from router.openai.logprobs import chat_logprobs, prompt_logprobs_map
from router.openai.protocol import ChatCompletionRequest
from router.openai.protocol_responses import (ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
                                              ChatResponseMessage, DeltaMessage, DeltaToolCall, ToolCallOut)
from router.openai.serving import ChunkFormat, OpenAIServing, RequestOptions
from router.openai.streaming import event
from router.openai.structured_fields import Constraint, constraint
from router.openai.tool_calling import ToolCalling
from router.openai.tool_parsers import ParserDelta, ToolParser


class OpenAIServingChat(OpenAIServing):
    id_prefix = "chatcmpl"

    def options(self, body: ChatCompletionRequest) -> RequestOptions:
        cfg = self.gw.cfg
        tools = ToolCalling.of(body, cfg.tool_call_parser, cfg.enable_auto_tool_choice)
        asked = constraint(body)
        if tools is not None and tools.constraint is not None:
            if asked is not None:
                raise InvalidRequestError(f"a tool_choice that forces a call cannot be combined with {asked.param}",
                                          asked.param)
            asked = Constraint(tools.constraint, "tools")
        # A reply read for tool calls keeps its special tokens (their tags may be special tokens).
        skip = body.skip_special_tokens is not False and not (tools is not None and tools.parses)
        return RequestOptions(asked, skip, tools)

    def prompts(self, body: ChatCompletionRequest) -> list:
        return [body.messages]

    def encode(self, messages, opts: RequestOptions) -> list[int]:
        tools = list(opts.tools.template_tools) if opts.tools is not None else None
        return encode_chat(self.gw.tokenizer, [m.as_template_dict() for m in messages], tools)

    def max_tokens(self, body: ChatCompletionRequest, ids) -> int:
        max_tokens = body.requested_max_tokens
        if max_tokens is None:  # like vLLM: as much as the context (and the KV cache) leaves
            cfg = self.gw.cfg
            max_tokens = default_max_tokens(len(ids), cfg.max_model_len, self.gw.kv_capacity_tokens(),
                                            cfg.sampling_defaults.max_tokens)
        return max_tokens

    def num_logprobs(self, body: ChatCompletionRequest) -> int | None:
        return body.num_logprobs

    def response(self, rid, body, opts, choices, results, usage):
        out = []
        tools = opts.tools
        for c, (text, positions) in zip(choices, results):
            logprobs = chat_logprobs(positions, body.num_logprobs) if body.num_logprobs is not None else None
            finish = c.gen.finish_reason
            if tools is not None and tools.parses:
                content, calls = tools.parse(text)
                message = ChatResponseMessage(content=content, tool_calls=[
                    ToolCallOut.model_validate(call.to_openai()) for call in calls] or None)
                finish = tools.finish_reason(bool(calls), finish)
            else:
                message = ChatResponseMessage(content=text)
            out.append(ChatChoice(index=c.index, message=message, logprobs=logprobs, finish_reason=finish))
        prompt_lps = None
        if body.prompt_logprobs is not None:  # one prompt: every choice has the same
            prompt_lps = prompt_logprobs_map(choices[0].prompt_logprobs(), body.prompt_logprobs)
        return ChatCompletionResponse(id=rid, model=body.model, usage=usage, choices=out, prompt_logprobs=prompt_lps)

    def chunks(self, rid, body, opts, created):
        return _ChatChunks(rid, body, opts.tools, created)


class _ChatChunks(ChunkFormat):
    def __init__(self, rid: str, body: ChatCompletionRequest, tools: ToolCalling | None, created: int):
        self.rid, self.body, self.created = rid, body, created
        self.tools = tools if tools is not None and tools.parses else None
        self.parsers: dict[int, ToolParser] = {}  # per choice, with tools

    def _chunk(self, index: int, delta: DeltaMessage, finish: str | None, positions=(), usage=None) -> str:
        logprobs = None
        if self.body.num_logprobs is not None and positions:
            logprobs = chat_logprobs(positions, self.body.num_logprobs)
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model,
                                choices=[ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                                                         finish_reason=finish)])
        d = c.model_dump(exclude_none=True)
        d["choices"][0]["finish_reason"] = finish  # always present, null until the end
        if self.body.include_usage:
            d["usage"] = None if usage is None else {"prompt_tokens": usage.prompt_tokens,
                                                    "completion_tokens": usage.completion_tokens,
                                                    "total_tokens": usage.total_tokens}
        return event(json.dumps(d, separators=(",", ":")))

    def opening(self, index):
        return [self._chunk(index, DeltaMessage(role="assistant", content=""), None)]

    def piece(self, index, text, finish, positions, usage=None):
        if self.tools is None:
            return self._chunk(index, DeltaMessage(content=text) if text else DeltaMessage(), finish, positions, usage)
        parser = self.parsers.get(index)
        if parser is None:
            parser = self.parsers[index] = self.tools.new_parser()
        d = parser.feed(text)
        if finish is not None:
            end = parser.finish()
            d = ParserDelta(d.content + end.content, d.tool_calls + end.tool_calls)
            finish = self.tools.finish_reason(parser.called, finish)
        calls = [DeltaToolCall.model_validate(x.to_openai()) for x in self.tools.kept_deltas(d.tool_calls)]
        delta = DeltaMessage(content=d.content or None, tool_calls=calls or None)
        return self._chunk(index, delta, finish, positions, usage)

    def usage(self, usage):
        c = ChatCompletionChunk(id=self.rid, created=self.created, model=self.body.model, choices=[], usage=usage)
        return event(c.model_dump_json())
