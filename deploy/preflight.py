"""What `pdserve serve` checks before anything starts (no Ray, no worker, no port): the model, its
tokenizer, the chat template, the sampling defaults and the quantization it would serve with.

Each of these would otherwise fail inside a worker or an API-server process half a minute later,
after Ray and both workers started, its message cut by the actor's error report. Here it is one
PdserveError, whole, printed once by the CLI (and no "pdserve: stopped" line: nothing started).
`check_model` returns what the launcher then serves with (ServedModel), so nothing is resolved twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.distributed.sharding import check_tensor_parallel
from cluster.errors import InvalidRequestError, ModelLoadError
from cluster.sampling.generation_defaults import SamplingDefaults, load_sampling_defaults
from cluster.model.checkpoint import read_config
from cluster.model.config import ModelArchConfig
from cluster.model.demo import ensure_demo_model
from cluster.model.hub import resolve_model_dir
from cluster.model.quantization import QuantConfig
from cluster.sampling.sampling_params import SamplingParams
from cluster.text.tokenizer import check_chat_template, load_chat_template, load_tokenizer
from deploy.config import ClusterConfig


@dataclass(frozen=True)
class ServedModel:
    model_dir: Path  # what every worker and API server loads (a directory, a hub id's cached snapshot, a .gguf)
    name: str  # what clients pass as `model`
    arch: ModelArchConfig
    chat_template: str | None  # --chat-template's text (None: the tokenizer's own)
    sampling_defaults: SamplingDefaults
    dtype: str = "float32"  # the activation dtype the workers run (`--dtype` resolved: "auto" is the checkpoint's)
    quantization: str = "none"  # QuantConfig.tag: "none", or the method and its schemes ("fp8:channel/dynamic")
    kv_cache_dtype: str = "float32"  # the KV cache's ("auto" resolved: the activation dtype)

    def precision(self) -> dict[str, str]:
        """What /v1/models, the start-up line and /metrics (pdserve:model_info) report."""
        return {"dtype": self.dtype, "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}


def check_model(cfg: ClusterConfig) -> ServedModel:
    """Raises PdserveError (ModelLoadError) naming what is wrong; returns what to serve."""
    model_dir = ensure_demo_model() if cfg.model is None else resolve_model_dir(cfg.model)
    arch = ModelArchConfig.from_dir(model_dir)
    for role in ("prefill", "decode"):  # a model the workers cannot split fails here, before Ray starts
        check_tensor_parallel(arch.num_heads, arch.num_kv_heads, arch.intermediate_size, cfg.tp_of(role),
                              f"{model_dir.name} ({role}_tp)")
    config, config_path = read_config(model_dir)
    quant = QuantConfig.from_checkpoint(config, cfg.quantization, str(config_path))
    dtype = _DTYPE_NAMES.get(cfg.dtype or "auto", cfg.dtype) if cfg.dtype not in (None, "auto") else arch.dtype
    kv_dtype = dtype if cfg.kv_cache_dtype == "auto" else "fp8_e4m3"
    template = load_chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    tokenizer = load_tokenizer(model_dir, template)
    check_chat_template(tokenizer, "--chat-template" if template is not None else str(model_dir))
    defaults = load_sampling_defaults(model_dir, cfg.generation_config)
    try:  # a default no request could be served with (temperature -1) is the model's error, not every request's
        SamplingParams(max_tokens=defaults.max_tokens or 16, temperature=defaults.temperature if
                       defaults.temperature is not None else 1.0, top_p=defaults.top_p if defaults.top_p is not None
                       else 1.0, top_k=defaults.top_k or 0, min_p=defaults.min_p or 0.0,
                       repetition_penalty=defaults.repetition_penalty or 1.0)
    except InvalidRequestError as e:
        raise ModelLoadError(f"the sampling defaults of {model_dir}/generation_config.json are invalid: {e} "
                             f"(--generation-config vllm ignores them)") from None
    name = cfg.served_model_name or ("pdserve-demo" if cfg.model is None else _default_name(cfg.model, model_dir))
    return ServedModel(model_dir, name, arch, template, defaults, str(dtype), quant.tag, kv_dtype)


_DTYPE_NAMES = {"half": "float16", "float": "float32"}  # --dtype's aliases, as torch names them


def _default_name(given: str, model_dir: Path) -> str:
    """A directory serves under its folder's name (as before), a GGUF file under its name without
    `.gguf`; a hub id under the id itself (as vLLM)."""
    if not Path(given).expanduser().exists():
        return given
    return model_dir.stem if model_dir.is_file() else model_dir.name
