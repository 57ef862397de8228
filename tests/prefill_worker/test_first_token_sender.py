"""The prefill worker sends each prompt's first token to its gateway itself, as soon as it is drawn
(prefill_worker/first_token_sender.py): before the decode side takes the KV, with the text, finish
and logprobs the decode side would have sent, under the cluster's MAC."""

import sys
from pathlib import Path

import pytest
import zmq

sys.path.insert(0, str(Path(__file__).parents[1] / "cluster" / "transport"))
import harness  # noqa: E402

from cluster.engine.engine import LLMEngine  # noqa: E402
from cluster.wire.frame_auth import TOKEN_STREAM, FrameVerifier  # noqa: E402
from cluster.wire.messages import GenerateRequest  # noqa: E402
from cluster.sampling.sampling_params import SamplingParams  # noqa: E402
from cluster.wire.stream_messages import decode_stream_batch  # noqa: E402
from cluster.text.tokenizer import load_tokenizer  # noqa: E402
from cluster.transport.factory import TransportSpec, create_transport  # noqa: E402
from cluster.worker.worker_config import WorkerConfig  # noqa: E402
from prefill_worker.prefill_worker import PrefillWorker  # noqa: E402

SECRET = b"k" * 32


@pytest.fixture
def setup(demo_model_dir, request):
    spec = TransportSpec("local", namespace=request.node.name, heartbeat_s=0.05)
    dec = harness.DecodeSide("d0", demo_model_dir, spec)
    w = PrefillWorker("p0", WorkerConfig(model_dir=str(demo_model_dir), num_blocks=64, max_prefill_tokens=64,
                                         cluster_secret=SECRET))
    w.set_transport(create_transport(spec, w.kv_cache, "p0", "prefill"), send_timeout_s=5.0)
    gateway = zmq.Context.instance().socket(zmq.PULL)
    address = f"tcp://127.0.0.1:{gateway.bind_to_random_port('tcp://127.0.0.1')}"
    yield dec, w, gateway, address
    gateway.close(linger=0)
    w.shutdown()
    w.transport.close()
    dec.transport.close()


def _received(gateway, n):
    verifier, out = FrameVerifier(SECRET, TOKEN_STREAM), []
    while len(out) < n:
        assert gateway.poll(30_000), f"{len(out)} of {n} first tokens reached the gateway"
        payload = verifier.open(gateway.recv_multipart())
        assert payload is not None  # signed with the cluster's secret
        out += decode_stream_batch(payload).deltas
    return {d.request_id: d for d in out}


def _req(rid, prompt, address, **params):
    return GenerateRequest(rid, tuple(prompt), SamplingParams(**params), 7, 0.0, reply_to=address)


def test_the_first_token_reaches_the_gateway_before_the_decode_side_takes_its_kv(setup, demo_model_dir):
    dec, w, gateway, address = setup
    tok = load_tokenizer(demo_model_dir)
    prompts = [list(range(5, 45)), list(range(60, 75)), list(range(80, 100))]
    eng = LLMEngine(demo_model_dir)
    ref = [eng.generate([p], SamplingParams(max_tokens=2, temperature=0.0, logprobs=2))[0] for p in prompts]
    stop = ref[2].token_ids[0]
    reqs = [_req("lp", prompts[0], address, max_tokens=5, temperature=0.0, logprobs=2),
            _req("one", prompts[1], address, max_tokens=1, temperature=0.0),  # ended by the first token: length
            _req("stop", prompts[2], address, max_tokens=5, temperature=0.0, stop_token_ids=[stop]),
            GenerateRequest("local", tuple(prompts[1]), SamplingParams(max_tokens=3, temperature=0.0), 7, 0.0)]
    tasks = [dec.reserve(r, "p0") for r in reqs]
    w.warmup()
    w.start()
    results = [w.submit(t).result(timeout=60) for t in tasks]
    got = _received(gateway, 3)  # the decode side never polled an arrival yet
    assert all(r.ok for r in results), results
    assert "local" not in got  # no gateway: its decode worker publishes it (drain())
    lp = got["lp"]
    assert lp.token_ids == (ref[0].token_ids[0],) and lp.text == tok.decode([ref[0].token_ids[0]])
    assert lp.finish_reason is None and lp.logprobs.tokens[0].token_id == ref[0].token_ids[0]
    assert lp.logprobs.tokens[0].logprob == pytest.approx(ref[0].logprobs[0].logprob, abs=1e-4)
    assert lp.logprobs.tokens[0].top_ids == ref[0].logprobs[0].top_ids
    assert (got["one"].token_ids, got["one"].finish_reason) == ((ref[1].token_ids[0],), "length")
    # A stop token: its id goes out, its text does not (the decode side's rule, cluster.text.stream_text)
    assert (got["stop"].token_ids, got["stop"].text, got["stop"].finish_reason) == ((stop,), "", "stop")
    arrivals = {a.reservation.request_id: a for a in dec.wait_arrivals(4)}
    assert all(arrivals[r.request_id].header.first_token == res.first_token for r, res in zip(reqs, results))
    for res in results:  # its timeline: the token left before the KV commit
        tl = res.timeline
        assert tl.submitted <= tl.forward_start <= tl.forward_done <= tl.first_token_sent <= tl.kv_committed, tl
        assert tl.pass_device_s > 0 and tl.pass_host_s > 0 and tl.pass_tokens > 0


def test_a_first_token_that_cannot_be_sent_fails_its_prompt(setup, monkeypatch):
    """Never lost silently: the prompt fails (its decode worker frees the blocks, no first token), and
    the router migrates it from the tokens its client has."""
    dec, w, gateway, address = setup

    def refuse(*a, **k):
        raise zmq.Again("resource temporarily unavailable")
    monkeypatch.setattr(w.first_tokens, "send", refuse)
    task = dec.reserve(_req("r", range(5, 30), address, max_tokens=4, temperature=0.0), "p0")
    w.start()
    res = w.submit(task).result(timeout=60)
    assert not res.ok and "first token could not be sent" in res.error
    (a,) = dec.wait_arrivals(1)
    assert not a.header.ok
    assert w.allocator.num_free == w.allocator.capacity


def test_the_first_token_does_not_wait_for_the_reservation(setup, demo_model_dir):
    """A prompt dispatched before its decode worker reserved (PrefillTask without a reservation):
    its first token reaches the gateway while the KV still has nowhere to go; the KV ships when the
    reservation comes (attach), and the decode side continues from the same token."""
    from cluster.wire.messages import PrefillTask

    dec, w, gateway, address = setup
    prompt = list(range(5, 45))
    ref = LLMEngine(demo_model_dir).generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))[0]
    req = _req("early", prompt, address, max_tokens=4, temperature=0.0)
    w.start()
    fut = w.submit(PrefillTask(req))
    got = _received(gateway, 1)
    assert got["early"].token_ids == (ref.token_ids[0],)
    assert not fut.done() and not dec.transport.poll_arrivals()  # computed; its KV waits (parked)
    task = dec.reserve(req, "p0")
    w.attach(req.request_id, task.reservation)
    result = fut.result(timeout=30)
    (a,) = dec.wait_arrivals(1)
    assert result.ok and result.first_token == ref.token_ids[0] and a.header.first_token == ref.token_ids[0]
    assert dec.greedy_decode(req, a.reservation.block_ids, a.header.first_token) == list(ref.token_ids)
    tl = result.timeline
    assert tl.first_token_sent <= tl.kv_committed and tl.forward_done <= tl.first_token_sent
    assert w.allocator.num_free == w.allocator.capacity
