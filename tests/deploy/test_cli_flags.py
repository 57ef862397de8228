"""The CLI as a new user (and a vLLM user) meets it: `--version`, a subcommand's own usage for a bad
flag, help text, vLLM's serving flags and their YAML keys, and the errors `pdserve serve` finds
before Ray starts (a model without a tokenizer, a bad chat template, a bad config, a hub id not in
the local cache), each printed once, whole, with no `pdserve: stopped` line (nothing started).

None of these start Ray: the error ones check that it was not started (no Ray log line; in-process,
the launcher's Ray start refuses to run). One of them runs `pdserve serve` as a subprocess, for the
real exit code and stderr end to end; the others call the CLI's entry point in-process (the same
`main(argv)`, without a second interpreter importing torch and Ray for each). The error after start
(`error:` before `pdserve: stopped`) is in test_serve_command.py, which starts Ray.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deploy.cli import build_parser
from deploy.config import ClusterConfig
from deploy.human_readable_int import human_readable_int
from deploy.config_flags import overrides_from_args

RAY_STARTED = ("Started a local Ray instance", "ray.init", "Connecting to existing Ray cluster")


def _pdserve(*args, env=None, timeout=180):
    e = dict(os.environ, RAY_ADDRESS="", **(env or {}))
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=e)


def _one_error(r, *needles):
    """rc 2, the error once (and whole: every needle in it), nothing of Ray, no stopped line."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, r.stderr
    text = r.stderr[r.stderr.index("error: "):]
    for n in needles:
        assert n in text, (n, r.stderr)
    assert "Traceback" not in r.stderr and "pdserve: stopped" not in r.stderr
    assert not any(s in r.stderr + r.stdout for s in RAY_STARTED), r.stderr


@pytest.fixture
def pdserve_main(monkeypatch, capsys):
    """`pdserve ARGS` in this process: cli.main(argv) with its stdout and stderr captured, as a
    CompletedProcess. The launcher's Ray start and its workers' placement fail the test if reached
    (the errors here are the ones found before Ray starts)."""
    import deploy.serving_cluster as serving_cluster
    from deploy import cli

    def no_ray(*a, **k):
        raise AssertionError("Ray was started")
    monkeypatch.setattr(serving_cluster, "init_ray", no_ray)
    monkeypatch.setattr(serving_cluster.RayWorkers, "place", no_ray)
    monkeypatch.setenv("RAY_ADDRESS", "")

    def run(*args):
        capsys.readouterr()
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["pdserve", *args], code, out, err)
    return run


def _model_copy(demo_model_dir: Path, dst: Path, tokenizer: bool = True) -> Path:
    shutil.copytree(demo_model_dir, dst)
    if not tokenizer:
        for f in dst.iterdir():
            if "token" in f.name or f.name.endswith((".model", ".jinja")):
                f.unlink()
    return dst


# -- the parser ---------------------------------------------------------------------------------------
def test_version():
    r = _pdserve("--version")
    assert r.returncode == 0 and r.stdout.startswith("pdserve 0.1.0"), r


@pytest.mark.parametrize("cmd", ["serve", "generate"])
def test_a_bad_flag_prints_the_subcommands_usage(cmd):
    r = _pdserve(cmd, "--no-such-flag")
    assert r.returncode == 2
    assert r.stderr.startswith(f"usage: pdserve {cmd} "), r.stderr
    assert f"pdserve {cmd}: error: unrecognized arguments: --no-such-flag" in r.stderr


def test_serve_help_shows_every_default():
    r = _pdserve("serve", "--help")
    assert r.returncode == 0 and "PydanticUndefined" not in r.stdout
    flat = " ".join(r.stdout.split())
    assert "--prefill-resources PREFILL_RESOURCES" in flat and "(default: {})" in flat
    for flag in ("--gpu-memory-utilization", "--enforce-eager", "--chat-template", "--generation-config",
                 "--max-model-len", "--served-model-name", "--quantization {fp8}", "--kv-cache-dtype {auto,fp8,fp8_e4m3}",
                 "--dtype {auto,float32,float,float16,half,bfloat16}"):
        assert flag in flat, flag


# -- vLLM's flags: the same meaning, and each a YAML key -------------------------------------------------
VLLM_FLAGS = ["--gpu-memory-utilization", "0.8", "--enforce-eager", "--chat-template", "t.jinja",
              "--generation-config", "vllm", "--max-model-len", "8k", "--served-model-name", "llama",
              "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3", "--dtype", "auto"]
VLLM_VALUES = dict(gpu_memory_utilization=0.8, enforce_eager=True, chat_template="t.jinja", generation_config="vllm",
                   max_model_len=8000, served_model_name="llama", quantization="fp8", kv_cache_dtype="fp8_e4m3",
                   dtype=None)


def test_vllm_flags_parse_as_vllm_reads_them():
    args = build_parser().parse_args(["serve", "/m", *VLLM_FLAGS])
    cfg = ClusterConfig.load(None, overrides_from_args(args), env={})
    assert {k: getattr(cfg, k) for k in VLLM_VALUES} == VLLM_VALUES


def test_vllm_flags_are_yaml_keys(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("gpu_memory_utilization: 0.8\nenforce_eager: true\nchat_template: t.jinja\ngeneration_config: vllm\n"
                 "max_model_len: 8k\nserved_model_name: llama\nquantization: fp8\nkv_cache_dtype: fp8_e4m3\n"
                 "dtype: auto\n")
    cfg = ClusterConfig.load(y, {}, env={})
    assert {k: getattr(cfg, k) for k in VLLM_VALUES} == VLLM_VALUES


@pytest.mark.parametrize("text,value", [("8k", 8000), ("8K", 8192), ("1m", 1_000_000), ("1M", 1 << 20),
                                        ("25.6k", 25600), ("4096", 4096), (" 2k ", 2000), ("1g", 10**9)])
def test_max_model_len_takes_vllms_suffixes(text, value):
    assert human_readable_int(text) == value
    assert ClusterConfig(max_model_len=text).max_model_len == value


@pytest.mark.parametrize("text", ["8.5K", "8x", "k", "", "1.5"])
def test_max_model_len_refuses_what_vllm_refuses(text):
    from cluster.errors import PdserveError

    with pytest.raises(PdserveError, match="max_model_len"):
        ClusterConfig.load(None, {"max_model_len": text}, env={})


@pytest.mark.parametrize("given,canonical", [("auto", None), ("half", "float16"), ("float", "float32"),
                                             ("bfloat16", "bfloat16"), (None, None)])
def test_dtype_names_as_vllm(given, canonical):
    assert ClusterConfig(dtype=given).dtype == canonical


def test_gpu_memory_utilization_bounds_weights_activations_and_kv_together():
    """vLLM's meaning: weights + activations + KV within that fraction of the (share of the) GPU."""
    from cluster.kv.kv_cache import DeviceMemory, KVCacheSpec, kv_pool_blocks
    from cluster.model.config import ModelArchConfig
    from cluster.worker.worker_config import WorkerConfig

    arch = ModelArchConfig.from_dict({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                                      "intermediate_size": 14336})
    gib = 1 << 30
    mem = DeviceMemory(total=140 * gib, free=124 * gib, reserved_here=16 * gib)  # 16 GiB of weights loaded
    per_block = KVCacheSpec.for_model(arch, 16, 1, torch.bfloat16).bytes_per_block
    blocks = {}
    for util in (0.5, 0.9):
        cfg = WorkerConfig("/m", device="cuda", gpu_memory_utilization=util)
        blocks[util] = kv_pool_blocks(cfg, arch, torch.bfloat16, torch.device("cuda"), mem) - 1
        used = 16 * gib + blocks[util] * per_block
        assert used <= util * 140 * gib  # the weights and the KV stay within it, with the headroom left
        assert used + 4 * gib >= util * 140 * gib  # and nothing much is wasted (headroom ~1-3 GiB here)
    # 0.4 of the GPU more is 0.4 x 140 GiB more KV
    assert abs((blocks[0.9] - blocks[0.5]) * per_block - 0.4 * 140 * gib) < 2 * per_block
    # a share of the GPU (two workers on one): the fraction is of the share
    half = WorkerConfig("/m", device="cuda", gpu_memory_utilization=0.9, gpu_share=0.5)
    mem2 = DeviceMemory(total=140 * gib, free=100 * gib, reserved_here=16 * gib)
    assert (kv_pool_blocks(half, arch, torch.bfloat16, torch.device("cuda"), mem2) - 1) * per_block + 16 * gib \
        <= 0.9 * 70 * gib


# -- generation_config.json: the model's sampling defaults (vLLM's --generation-config) -------------------
def test_sampling_defaults_from_generation_config(tmp_path, demo_model_dir):
    from cluster.sampling.generation_defaults import SamplingDefaults, load_sampling_defaults

    m = _model_copy(demo_model_dir, tmp_path / "m")
    (m / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
         "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}))
    want = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=64)
    assert load_sampling_defaults(m, "auto") == want
    assert load_sampling_defaults(m, "vllm") == SamplingDefaults()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.3}')
    assert load_sampling_defaults(m, str(other)) == SamplingDefaults(temperature=0.3)


def test_the_gateway_applies_the_defaults_unless_the_request_sets_them(demo_model_dir):
    from cluster.sampling.generation_defaults import SamplingDefaults
    from cluster.text.tokenizer import load_tokenizer
    from router.openai.gateway_config import GatewayConfig
    from router.openai.protocol import ChatCompletionRequest, CompletionRequest
    from router.openai.serving_chat import OpenAIServingChat
    from router.openai.serving_completion import OpenAIServingCompletion

    class GW:
        tokenizer = load_tokenizer(demo_model_dir)

        def __init__(self, d):
            self.cfg = GatewayConfig("m", 4096, vocab_size=len(self.tokenizer), sampling_defaults=d)

        def kv_capacity_tokens(self):
            return 0

    d = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1, max_tokens=64)
    for serving, body in ((OpenAIServingCompletion, CompletionRequest(model="m", prompt="hi")),
                          (OpenAIServingChat, ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}]))):
        s = serving(GW(d))
        p = s.sampling_params(body, s.options(body), s.max_tokens(body, [1, 2, 3]), None, None)
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 64)
        own = body.model_copy(update=dict(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                          max_tokens=5))
        p = s.sampling_params(own, s.options(own), s.max_tokens(own, [1, 2, 3]), None, None)
        assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.0, 1.0, 0, 0.0, 1.0, 5)
        plain = serving(GW(SamplingDefaults()))  # --generation-config vllm: the API's own defaults
        p = plain.sampling_params(body, plain.options(body), plain.max_tokens(body, [1, 2, 3]), None, None)
        assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)
        assert p.max_tokens == (16 if serving is OpenAIServingCompletion else 4096 - 3)


# -- errors found before Ray starts ---------------------------------------------------------------------
def test_model_without_a_tokenizer_fails_before_ray_once_and_whole(tmp_path, demo_model_dir):
    m = _model_copy(demo_model_dir, tmp_path / "no-tok", tokenizer=False)
    # Generous: the command imports torch, transformers and Ray before it loads the tokenizer (~15 s of CPU
    # on a fast machine), minutes at the other test stream's nice 10 on a busy one.
    r = _pdserve("serve", str(m), "--port", "0", timeout=420)
    _one_error(r, "cannot load a tokenizer from", str(m))


def test_bad_chat_template_fails_before_ray(tmp_path, demo_model_dir, pdserve_main):
    r = pdserve_main("serve", str(demo_model_dir), "--chat-template", "{% for m in messages %}{{ m.content }")
    _one_error(r, "chat template", "does not render", "TemplateSyntaxError")
    r = pdserve_main("serve", str(demo_model_dir), "--chat-template", str(tmp_path / "missing.jinja"))
    _one_error(r, "looks like a file path")
    raising = tmp_path / "raises.jinja"
    raising.write_text("{{ raise_exception('no chats here') }}")
    r = pdserve_main("serve", str(demo_model_dir), "--chat-template", str(raising))
    _one_error(r, "no chats here")


def test_a_good_chat_template_reaches_the_tokenizer(tmp_path, demo_model_dir):
    from cluster.text.tokenizer import check_chat_template, encode_chat, load_chat_template, load_tokenizer

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}")
    tok = load_tokenizer(demo_model_dir, load_chat_template(str(f)))
    check_chat_template(tok, str(f))
    ids = encode_chat(tok, [{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == tok.decode(tok("<user>hi<a>", add_special_tokens=False).input_ids)
    assert load_chat_template("{{ x }}") == "{{ x }}"  # the template itself, as vLLM takes it


@pytest.mark.parametrize("breakage,needle", [
    (lambda m: (m / "config.json").write_text("{not json"), "is not valid JSON"),
    (lambda m: (m / "config.json").write_text('{"model_type": "falcon"}'), "unsupported architecture 'falcon'"),
    (lambda m: (m / "generation_config.json").write_text('{"temperature": "hot"}'), "temperature must be a number"),
    (lambda m: (m / "generation_config.json").write_text('{"temperature": -1}'), "sampling defaults"),
    (lambda m: (m / "config.json").write_text(json.dumps({**json.loads((m / "config.json").read_text()),
                                                          "quantization_config": {"quant_method": "awq"}})), "awq"),
])
def test_a_bad_model_directory_fails_before_ray(tmp_path, demo_model_dir, breakage, needle, pdserve_main):
    m = _model_copy(demo_model_dir, tmp_path / "m")
    breakage(m)
    _one_error(pdserve_main("serve", str(m)), needle)


def _fake_hub_cache(root: Path, repo: str, model_dir: Path) -> Path:
    """huggingface_hub's cache layout: models--org--name/{refs/main, snapshots/<commit>/...}."""
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text("0123456789abcdef0123456789abcdef01234567")
    shutil.copytree(model_dir, d / "snapshots" / "0123456789abcdef0123456789abcdef01234567")
    return d / "snapshots" / "0123456789abcdef0123456789abcdef01234567"


def test_hub_id_resolves_from_the_local_cache(tmp_path, demo_model_dir, pdserve_main, monkeypatch):
    import huggingface_hub.constants as c

    from cluster.errors import ModelLoadError
    from cluster.model.hub import resolve_model_dir

    snap = _fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", demo_model_dir)
    # What HF_HUB_CACHE (read when huggingface_hub is imported) sets; offline, as HF_HUB_OFFLINE=1.
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    r = pdserve_main("generate", "--model", "acme/tiny-llama", "--max-tokens", "3", "--ignore-eos", "Hello")
    assert r.returncode == 0, r.stderr
    ref = pdserve_main("generate", "--model", str(demo_model_dir), "--max-tokens", "3", "--ignore-eos", "Hello")
    assert r.stdout.strip() and r.stdout == ref.stdout  # the same model, found in the cache
    # the same rule: the snapshot folder; a revision after @
    assert resolve_model_dir("acme/tiny-llama") == snap
    assert resolve_model_dir("acme/tiny-llama@0123456789abcdef0123456789abcdef01234567") == snap
    with pytest.raises(ModelLoadError, match="nor in the local Hugging Face cache"):
        resolve_model_dir("acme/other")
    with pytest.raises(ModelLoadError, match="model directory not found"):
        resolve_model_dir(str(tmp_path / "nope" / "deeper"))


def test_hub_id_not_in_the_cache_fails_before_ray(tmp_path, pdserve_main, monkeypatch):
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    r = pdserve_main("serve", "meta-llama/Llama-3.1-8B-Instruct")
    _one_error(r, "meta-llama/Llama-3.1-8B-Instruct is neither a model directory nor in the local Hugging Face "
                  "cache", "hf download meta-llama/Llama-3.1-8B-Instruct")


def test_served_name_of_a_hub_id_is_the_id(tmp_path, demo_model_dir, monkeypatch):
    import huggingface_hub.constants as c

    from deploy.preflight import check_model

    _fake_hub_cache(tmp_path / "hub", "acme/tiny-llama", demo_model_dir)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    served = check_model(ClusterConfig(model="acme/tiny-llama"))
    assert served.name == "acme/tiny-llama" and (served.model_dir / "config.json").is_file()
    assert check_model(ClusterConfig(model=str(demo_model_dir))).name == demo_model_dir.name
    assert check_model(ClusterConfig()).name == "pdserve-demo"


def test_generate_takes_dtype_auto_and_the_fp8_flags(demo_model_dir, pdserve_main):
    base = ["generate", "--model", str(demo_model_dir), "--max-tokens", "4", "--ignore-eos", "Hello"]
    auto = pdserve_main(*base, "--dtype", "auto")
    plain = pdserve_main(*base)
    assert auto.returncode == 0 and auto.stdout == plain.stdout, auto.stderr
    for extra in (["--quantization", "fp8"], ["--kv-cache-dtype", "fp8"]):
        r = pdserve_main(*base, *extra)
        assert r.returncode == 0 and r.stdout.strip(), (extra, r.stderr)


def test_loadtest_writes_outside_the_installed_package(tmp_path, monkeypatch):
    import loadtest
    from loadtest.run import default_out_dir

    monkeypatch.chdir(tmp_path)
    out = default_out_dir()
    assert out.parent == tmp_path / "pdserve-loadtest" and out.name.startswith("run-")
    assert Path(loadtest.__file__).resolve().parent not in out.parents
