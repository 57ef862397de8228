"""GatewayConfig: the OpenAI gateway's frozen settings (router/openai/gateway.py).

Its own module, importing nothing heavy (the sampling defaults' dataclass only), so that the application's ClusterConfig (deploy/config.py) takes
the gateway's defaults from here without importing FastAPI and the router (Ray): `pdserve serve
--help` stays light, and a default lives in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.sampling.generation_defaults import SamplingDefaults


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 4 << 20
    token_timeout_s: float = 600.0  # no token for this long: the request fails (a stuck worker)
    default_max_tokens: int = 16  # /v1/completions without max_tokens (OpenAI's default)
    vocab_size: int | None = None  # the model's (token ids in sampling parameters must be below it)
    tool_call_parser: str | None = None  # router/openai/tool_parsers name; None: tool calls are not parsed
    enable_auto_tool_choice: bool = False  # tool_choice "auto" is served (it needs tool_call_parser)
    # What a request that leaves temperature, top_p, top_k, min_p, repetition_penalty or max_tokens
    # unset gets (--generation-config: the model's generation_config.json, as vLLM).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # What the workers serve with, reported by /v1/models (None: not told, e.g. a test's gateway).
    dtype: str | None = None  # the activation dtype ("bfloat16")
    quantization: str | None = None  # "none", or the method and its schemes ("fp8:channel/dynamic")
    kv_cache_dtype: str | None = None
