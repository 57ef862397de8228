import os
import shutil
from pathlib import Path

import pytest
import torch

from duration_recorder import DurationRecorder
from stream_scheduling import StreamPlugin


# Pieces built without a launcher (unit tests) sign and check with an empty secret; outside a test run
# an empty secret is refused (cluster/wire/frame_auth.py: require_secret).
os.environ["PDSERVE_TEST_EMPTY_SECRET"] = "1"


def pytest_configure(config):
    # Keep the demo model and Ray's files out of the user's home during tests.
    root = Path(os.environ.setdefault("PDSERVE_HOME", str(Path(config.rootpath) / ".pytest_pdserve_home")))
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    streams = StreamPlugin(_in_cluster_stream)
    config.pluginmanager.register(DurationRecorder(config, stream_of=streams.stream_of), "pdserve-durations")
    config.pluginmanager.register(streams, "pdserve-streams")
    if not torch.cuda.is_available():
        # Triton kernels run on CPU under the interpreter, whichever test imports triton first: the
        # language module decides at import whether @triton.jit functions are interpreted
        # (tests/triton_interpreter.py then patches the interpreter for NumPy 2.4).
        os.environ.setdefault("TRITON_INTERPRET", "1")


# The clusters shared across modules (tests/router/conftest.py, tests/real_model/conftest.py), by the
# modules that share them: those modules run in one stretch, which starts each of them once
# (cluster_cache) and stops them at its end.
SHARED_CLUSTERS = {"fake_cluster": "router-session-clusters", "real_decode_cluster": "router-session-clusters",
                   "real_pd_cluster": "router-session-clusters", "smollm2_cluster": "real-model-cluster"}
SESSION_CLUSTERS_GROUP = "router-session-clusters"
# What the inner-loop tier (`-m "not slow"`) leaves out besides a module's own `pytestmark = slow` or
# `cluster` (the modules whose tests start processes of the system: servers, scripts, spawned ranks): a
# test on the run's Ray, and one on the trained model (transformers' GGUF load alone is ~25 s of one core).
SLOW_FIXTURES = {"ray_session", "hf_smollm2", "smollm2_cluster"}
# The run is two streams on the two pytest-xdist workers (pyproject's addopts; tests/stream_scheduling.py):
# - one test at a time on one worker: every test that starts a Ray cluster (marker
#   `cluster`: on the run's one Ray, on a Ray of its own, or in `pdserve serve` subprocesses) and every
#   test on transformers' copy of SmolLM2 (loaded once, in that worker). Two clusters at once on two
#   cores break the reliability tests' time bounds (each keeps ~10 processes busy);
# - every other module, one module at a time, on the other worker: they fill the third of the two
#   cores a cluster test leaves idle (tests/reliability's bounds hold beside them).
CLUSTER_STREAM_FIXTURES = {"ray_session", "hf_smollm2"}
CACHE_GROUP = pytest.StashKey[str]()  # the stretch of tests whose cached clusters live together


def _in_cluster_stream(item) -> bool:
    # A marker, not `item.keywords`: those hold the names of the test's directories too (tests/cluster/).
    return (item.get_closest_marker("cluster") is not None or "own_ray" in item.keywords
            or bool(CLUSTER_STREAM_FIXTURES & set(item.fixturenames)))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(item.fixturenames) or _in_cluster_stream(item):
            item.add_marker(pytest.mark.slow)
    shared_group = {item.module.__name__: SHARED_CLUSTERS[f] for item in items for f in item.fixturenames
                    if f in SHARED_CLUSTERS}
    on_session_clusters = {m for m, g in shared_group.items() if g == SESSION_CLUSTERS_GROUP}
    for item in items:
        item.stash[CACHE_GROUP] = shared_group.get(item.module.__name__, item.nodeid.split("::")[0])
    # In this order (xdist hands the scopes out in it: --no-loadscope-reorder): the cluster stream first
    # (the longest; the first worker takes it whole, the other every module after it), and in it a
    # module's tests kept together: a module with a Ray of its own first, before the run's one Ray
    # starts (ray_session, on first use; one process holds one Ray); then the session-long clusters'
    # modules (started early, they end early).
    items.sort(key=lambda item: (not _in_cluster_stream(item), 0 if "own_ray" in item.keywords
                                 else 1 if item.module.__name__ in on_session_clusters else 2))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def ray_session():
    """One Ray for the whole run (per pytest-xdist worker), shared by every cluster of every test
    directory: each cluster names its actors and placement group by its own tag and stops them on
    shutdown, so clusters come and go on it. Started on first use."""
    ray = pytest.importorskip("ray")
    from serving_harness import init_ray

    owned = init_ray()
    yield ray
    if owned:
        ray.shutdown()


@pytest.fixture(scope="session")
def ray_address(ray_session) -> str:
    """The run's one Ray's address, for the `pdserve serve` subprocesses (and run scripts) whose own
    Ray is not what they test: given as RAY_ADDRESS, the launcher joins it (deploy/config.py) instead
    of starting a local Ray (~7 s and ~10 s of CPU each on two cores) and stopping it again. The tests
    whose subject includes the command's own Ray leave it out: test_serve_answers_then_sigterm_stops_cleanly,
    test_drain.py's one-API-server drain, second SIGTERM and GCS-killed tests, test_multinode.py."""
    return ray_session.get_runtime_context().gcs_address


CLUSTER_CACHE = pytest.StashKey()


@pytest.fixture(scope="session")
def cluster_cache(ray_session, request):
    """Started clusters by configuration (tests/cluster_cache.py), closed when the tests of a
    stretch (CACHE_GROUP) are done (pytest_runtest_teardown below) and at the end of the run."""
    from cluster_cache import ClusterCache

    cache = request.config.stash[CLUSTER_CACHE] = ClusterCache()
    yield cache
    cache.close_all()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # The last test of a stretch (a module, or the modules on one shared cluster): its cached clusters
    # go, not to idle under the next tests on this worker. `nextitem` is the next test this process runs.
    if nextitem is not None and nextitem.stash[CACHE_GROUP] == item.stash[CACHE_GROUP]:
        return
    cache = item.config.stash.get(CLUSTER_CACHE, None)
    if cache is not None:
        cache.close_all()


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from cluster.model.demo import ensure_demo_model

    return ensure_demo_model()


@pytest.fixture(scope="session")
def reference_engine(demo_model_dir):
    """The in-process engine every cluster test compares its outputs with."""
    from cluster.engine.engine import LLMEngine

    return LLMEngine(demo_model_dir, num_blocks=1024, max_num_seqs=64)


def _save_hf_variant(config, demo_dir: Path, out: Path, seed: int) -> Path:
    """A checkpoint written by transformers itself (sharded), with peaked random weights."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "embed_tokens" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5)
    model.save_pretrained(out, max_shard_size="300KB")
    for f in demo_dir.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    assert (out / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    return out


@pytest.fixture(scope="session")
def qwen2_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    from transformers import Qwen2Config

    cfg = Qwen2Config(vocab_size=512, hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                      rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    return _save_hf_variant(cfg, demo_model_dir, tmp_path_factory.mktemp("qwen2"), seed=1)


@pytest.fixture(scope="session")
def mistral_model_dir(demo_model_dir, tmp_path_factory) -> Path:
    from transformers import MistralConfig

    # A short sliding window so that the long prompts in the tests cross it.
    cfg = MistralConfig(vocab_size=512, hidden_size=128, intermediate_size=224, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
                        sliding_window=96, bos_token_id=0, eos_token_id=1)
    return _save_hf_variant(cfg, demo_model_dir, tmp_path_factory.mktemp("mistral"), seed=2)
