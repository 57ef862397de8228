"""ClusterConfig: YAML, flags, environment, validation."""

from __future__ import annotations

import argparse

import pytest

from deploy.config import ClusterConfig
from deploy.config_flags import add_config_flags, overrides_from_args
from cluster.errors import PdserveError


def parse(argv):
    p = argparse.ArgumentParser()
    p.add_argument("model_dir", nargs="?", default=None)
    add_config_flags(p)
    return overrides_from_args(p.parse_args(argv))


def test_every_field_has_a_flag_and_a_docstring():
    p = argparse.ArgumentParser()
    add_config_flags(p)
    flags = {a.dest for a in p._actions}
    for name, field in ClusterConfig.model_fields.items():
        assert field.description, name
        assert name == "model" or name in flags, name


def test_yaml_then_env_then_flags(tmp_path):
    y = tmp_path / "cluster.yaml"
    y.write_text("decode-workers: 3\nprefill_workers: 2\nport: 9000\ngraph_buckets: [1, 2, 4]\napi_key: fromyaml\n")
    cfg = ClusterConfig.load(y, parse(["/models/x", "--port", "9100", "--no-use-cuda-graph"]), env={})
    assert (cfg.decode_workers, cfg.prefill_workers, cfg.port, cfg.model) == (3, 2, 9100, "/models/x")
    assert cfg.graph_buckets == (1, 2, 4) and cfg.use_cuda_graph is False and cfg.api_key == "fromyaml"
    assert ClusterConfig.load(y, {}, env={"PDSERVE_API_KEY": "env"}).api_key == "env"
    assert ClusterConfig.load(y, parse(["--api-key", "flag"]), env={"PDSERVE_API_KEY": "env"}).api_key == "flag"


def test_ray_address_from_the_environment_as_ray_reads_it(tmp_path):
    """RAY_ADDRESS is the environment's tier of `address`: over the YAML file, under the flags; empty
    is unset (a local Ray is started)."""
    y = tmp_path / "cluster.yaml"
    y.write_text("address: yaml-head:6379\n")
    assert ClusterConfig.load(None, {}, env={}).address is None
    assert ClusterConfig.load(None, {}, env={"RAY_ADDRESS": ""}).address is None
    assert ClusterConfig.load(None, {}, env={"RAY_ADDRESS": "10.0.0.5:6379"}).address == "10.0.0.5:6379"
    assert ClusterConfig.load(y, {}, env={}).address == "yaml-head:6379"
    assert ClusterConfig.load(y, {}, env={"RAY_ADDRESS": "env-head:6379"}).address == "env-head:6379"
    assert ClusterConfig.load(y, parse(["--address", "flag-head:6379"]),
                              env={"RAY_ADDRESS": "env-head:6379"}).address == "flag-head:6379"


@pytest.mark.parametrize("bad", [{"decode_workers": 0}, {"block_size": 12}, {"port": 70000},
                                 {"decode_policy": "random"}, {"graph_buckets": "1,x"}, {"api_key": " "},
                                 {"unknown_setting": 1}, {"kv_memory_fraction": 1.5},
                                 {"prefill_resources": "{not json"}, {"decode_resources": {"GPU": 1}},
                                 {"decode_resources": {"decode": -1}}, {"kv_store_port": 70000},
                                 {"kv_store_memory_limit_mib": 32}, {"kv_store_sweep_s": 0}])
def test_invalid_settings_are_one_line_errors(bad):
    with pytest.raises(PdserveError) as e:
        ClusterConfig.load(None, bad, env={})
    assert "\n" not in str(e.value)


def test_tool_call_flags(tmp_path):
    """vLLM's flags and their YAML keys; the parser's name is checked, auto tool choice needs a parser."""
    cfg = ClusterConfig.load(None, parse(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"]), env={})
    assert (cfg.tool_call_parser, cfg.enable_auto_tool_choice) == ("hermes", True)
    y = tmp_path / "c.yaml"
    y.write_text("tool-call-parser: mistral\n")
    cfg = ClusterConfig.load(y, {}, env={})
    assert (cfg.tool_call_parser, cfg.enable_auto_tool_choice) == ("mistral", False)
    assert ClusterConfig().tool_call_parser is None
    with pytest.raises(PdserveError, match="hermes, llama3_json, mistral") as e:
        ClusterConfig.load(None, {"tool_call_parser": "qwen9"}, env={})
    assert "tool_call_parser" in str(e.value)
    with pytest.raises(PdserveError, match="enable_auto_tool_choice needs tool_call_parser"):
        ClusterConfig.load(None, parse(["--enable-auto-tool-choice"]), env={})


def test_kv_store_settings_from_flags():
    cfg = ClusterConfig.load(None, parse(["/m", "--kv-store-memory-limit-mib", "256", "--kv-store-sweep-s", "0.5"]),
                             env={})
    assert (cfg.kv_store_memory_limit_mib, cfg.kv_store_sweep_s) == (256, 0.5)
    assert (ClusterConfig(model="/m").kv_store_memory_limit_mib, ClusterConfig(model="/m").kv_store_sweep_s) == (1024, 1.0)


def test_bad_yaml(tmp_path):
    with pytest.raises(PdserveError, match="does not exist"):
        ClusterConfig.load(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(PdserveError, match="mapping"):
        ClusterConfig.load(tmp_path / "list.yaml")


def test_tensor_parallel_flags_and_yaml_key(tmp_path):
    assert (lambda c: (c.prefill_tp, c.decode_tp))(ClusterConfig.load(None, parse([]), env={})) == (1, 1)
    cfg = ClusterConfig.load(None, parse(["--tensor-parallel-size", "2"]), env={})
    assert (cfg.prefill_tp, cfg.decode_tp, cfg.tp_of("prefill"), cfg.tp_of("decode")) == (2, 2, 2, 2)
    cfg = ClusterConfig.load(None, parse(["--prefill-tp", "2", "--decode-tp", "4"]), env={})
    assert (cfg.prefill_tp, cfg.decode_tp) == (2, 4)
    y = tmp_path / "c.yaml"
    y.write_text("tensor_parallel_size: 4\n")
    assert (lambda c: (c.prefill_tp, c.decode_tp))(ClusterConfig.load(y, {}, env={})) == (4, 4)
    # The alias and a role's own size may agree; they may not disagree.
    assert ClusterConfig.load(y, parse(["--decode-tp", "4"]), env={}).decode_tp == 4
    with pytest.raises(PdserveError, match="tensor_parallel_size 4 conflicts with decode_tp 2"):
        ClusterConfig.load(y, parse(["--decode-tp", "2"]), env={})


@pytest.mark.parametrize("bad,needle", [
    ({"prefill_tp": 0}, "prefill_tp"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"planner": True, "prefill_tp": 2, "decode_tp": 1}, "prefill_tp and decode_tp must be equal"),
    ({"kv_transport": "same_gpu", "decode_tp": 2}, "same_gpu"),
])
def test_inconsistent_tensor_parallel_settings_are_refused(bad, needle):
    with pytest.raises(PdserveError, match=needle):
        ClusterConfig.load(None, bad, env={})


def test_a_size_the_model_cannot_be_split_by_fails_before_ray_starts(demo_model_dir):
    """The demo model has 4 attention heads and 2 KV heads: TP 3 cannot split it, TP 4 replicates its KV
    heads. The error names the numbers and comes before Ray is started."""
    import ray

    from deploy.serving_cluster import ServingCluster

    was_up = ray.is_initialized()
    cfg = ClusterConfig(model=str(demo_model_dir), decode_tp=3, device="cpu", port=0)
    with pytest.raises(PdserveError, match="does not divide the 4 attention heads .*decode_tp"):
        ServingCluster(cfg).start()
    assert ray.is_initialized() == was_up


def test_api_key_from_a_file_the_environment_or_a_flag_once(tmp_path):
    """--api-key-file keeps the key out of `ps`; the key is one setting however it is given (a later
    source replaces an earlier one), and it never shows in the config's repr."""
    keyfile = tmp_path / "key"
    keyfile.write_text("sk-from-file\n")
    assert ClusterConfig.load(None, parse(["--api-key-file", str(keyfile)]), env={}).api_key == "sk-from-file"
    assert ClusterConfig.load(None, parse(["--api-key-file", str(keyfile)]),
                              env={"PDSERVE_API_KEY": "env"}).api_key == "sk-from-file"
    y = tmp_path / "c.yaml"
    y.write_text(f"api_key_file: {keyfile}\n")
    assert ClusterConfig.load(y, {}, env={"PDSERVE_API_KEY": "env"}).api_key == "env"
    assert ClusterConfig.load(y, parse(["--api-key", "flag"]), env={}).api_key == "flag"
    with pytest.raises(PdserveError, match="the API key once"):
        ClusterConfig.load(None, {"api_key": "a", "api_key_file": str(keyfile)}, env={})
    with pytest.raises(PdserveError, match="No such file"):
        ClusterConfig.load(None, {"api_key_file": str(tmp_path / "missing")}, env={})
    keyfile.write_text("\n")
    with pytest.raises(PdserveError, match="must not be empty"):
        ClusterConfig.load(None, {"api_key_file": str(keyfile)}, env={})
    assert "sk-from-file" not in repr(ClusterConfig(api_key="sk-from-file"))


@pytest.mark.parametrize("host", ["0.0.0.0", "0", "0x0", "0.0", "000.0.0.0", "::", "[::]", "*", "", " ", "224.0.0.1",
                                  "0:0:0:0:0:0:0:0", "10.1"])
def test_token_stream_host_is_an_allow_list(host):
    """Every spelling that binds all interfaces (inet_aton reads "0", "0x0", "0.0" as 0.0.0.0) is refused."""
    with pytest.raises(PdserveError, match="token_stream_host"):
        ClusterConfig.load(None, {"token_stream_host": host}, env={})


@pytest.mark.parametrize("host", ["10.0.0.5", "127.0.0.1", "::1", "fd00::5", "node-1.cluster.internal", "localhost"])
def test_token_stream_host_accepts_one_interface(host):
    assert ClusterConfig.load(None, {"token_stream_host": host}, env={}).token_stream_host == host


def test_listening_beyond_loopback_without_a_key_warns():
    assert ClusterConfig(host="0.0.0.0").security_warnings()
    assert ClusterConfig(host="10.0.0.5").security_warnings()
    assert not ClusterConfig(host="0.0.0.0", api_key="k").security_warnings()
    assert not ClusterConfig(host="127.0.0.1").security_warnings() and not ClusterConfig(host="::1").security_warnings()
