"""FP8 through the served path: a real 1 prefill + 1 decode cluster (Ray actors, the KV over the real
torch_dist transport on gloo, HTTP), serving with `--quantization fp8`, with `--kv-cache-dtype fp8`,
and a compressed-tensors FP8 checkpoint written by that library, gives the greedy output of LLMEngine
with the same settings (the engine is checked against a from-scratch FP8 reference in
tests/cluster/engine/test_engine_fp8.py). Every prompt is prefilled on the prefill worker (static placement,
threshold 0), so each one's K/V (e4m3 with the FP8 cache: its uint8 view on the wire) crosses the
transport. A pair whose KV numerics differ is refused at pair formation (plan.check_pair_numerics)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

import serving_harness
from cluster.engine.engine import LLMEngine
from cluster.sampling.sampling_params import SamplingParams

PROMPTS = ["Once upon a time there was a little", "The cat sat on the mat and looked at the",
           "In the beginning the sun rose over the hills and", "Hi"]
MAX_TOKENS = 12


def _served_greedy(url: str) -> list[str]:
    async def one(client, p, stream):
        body = {"model": serving_harness.MODEL, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        return await serving_harness.completion_text(client, body)

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            return await asyncio.gather(*(one(client, p, i % 2 == 0) for i, p in enumerate(PROMPTS)))
    return asyncio.run(main())


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name))


def _fp8_checkpoint(demo_model_dir, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    from fp8_checkpoints import write_compressed_tensors

    return write_compressed_tensors(demo_model_dir, tmp_path_factory.mktemp("ct") / "ct", "FP8_DYNAMIC")


CASES = {
    "quantization_fp8": (lambda demo, tmp: demo, {"quantization": "fp8"}),
    "kv_cache_fp8": (lambda demo, tmp: demo, {"kv_cache_dtype": "fp8"}),
    "compressed_tensors_checkpoint": (_fp8_checkpoint, {}),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_served_greedy_equals_the_engine(case, ray_session, demo_model_dir, tmp_path_factory):
    model_of, settings = CASES[case]
    model_dir = model_of(demo_model_dir, tmp_path_factory)
    engine = LLMEngine(model_dir, num_blocks=256, **settings)
    want = [o.text for o in engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                                    ignore_eos=True))]
    if case == "kv_cache_fp8":
        assert engine.runner.kv_cache.dtype.itemsize == 1
    sc = serving_harness.start_cluster(model_dir, prefill_workers=1, decode_workers=1, local_prefill_threshold=0,
                                       **settings)
    try:
        assert _served_greedy(sc.url) == want
        assert _metric(sc.url, 'pdserve:prefill_placements_total{model_name="pdserve-demo",reason="above_threshold"'
                               ',where="remote"}') == len(PROMPTS)
        sent = _metric(sc.url, "pdserve:kv_transfer_bytes_total")
        assert sent > 0
        if case == "kv_cache_fp8":
            # one byte an element: the blocks moved are a quarter of this float32 demo's
            prompt_tokens = sum(len(engine.tokenizer.encode(p)) for p in PROMPTS)
            per_token = 2 * engine.arch.num_layers * engine.arch.num_kv_heads * engine.arch.head_dim
            assert sent <= per_token * (prompt_tokens + len(PROMPTS) * 16)  # whole blocks at 1 byte an element
        info = httpx.get(f"{sc.url}/metrics").text
        dtype = settings.get("kv_cache_dtype", "auto")
        assert f'cache_dtype="{dtype}"' in info and "vllm:cache_config_info{" in info
    finally:
        sc.shutdown()
