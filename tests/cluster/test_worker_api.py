"""The worker interface (cluster/worker_api.py) is what both Ray actors implement and what the
router's WorkerClient calls: same methods, same parameters, same types, checked here; and every
method the router uses, called through WorkerClient on the real actor classes (in process, CPU, the
local KV transport), answers with the type the Protocol declares. The actors' other methods are the
fault interface (cluster/faults/fault_control.py), checked as exactly, and never called by the router."""

from __future__ import annotations

import asyncio
import inspect
import re
import types
import typing
import uuid
from pathlib import Path

import pytest

from cluster.faults.fault_control import DecodeFaultControl, FaultControl
from cluster.wire.messages import GenerateRequest, PrefillTask, ReserveRequest
from cluster.sampling.sampling_params import SamplingParams
from cluster.transport.factory import TransportSpec
from cluster.worker_api import DecodeWorkerAPI, PrefillWorkerAPI, WorkerAPI
from cluster.worker.worker_config import WorkerConfig
from decode_worker.actor import DecodeWorkerActor
from prefill_worker.actor import PrefillWorkerActor
from router.workers.prefill_answers import PrefillAnswers
from router.workers.worker_client import WorkerClient

ROOT = Path(__file__).resolve().parents[2]
# (serving interface, fault interface, the actor that implements both)
ACTORS = [(DecodeWorkerAPI, DecodeFaultControl, DecodeWorkerActor), (PrefillWorkerAPI, FaultControl, PrefillWorkerActor)]
PROTOCOLS = (WorkerAPI, DecodeWorkerAPI, PrefillWorkerAPI, FaultControl, DecodeFaultControl)
NAMES = {"TransportSpec": TransportSpec}  # behind TYPE_CHECKING in the modules


def protocol_methods(proto) -> dict[str, typing.Callable]:
    """Every method a Protocol declares, its bases' included."""
    out = {}
    for cls in reversed(proto.__mro__):
        if cls in PROTOCOLS:
            out.update({n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")})
    return out


def public_methods(cls) -> dict[str, typing.Callable]:
    return {n: f for n, f in vars(cls).items() if inspect.isfunction(f) and not n.startswith("_")}


# Ray rewrites an actor class's methods in place, adding this keyword (its tracing hook), once any
# test in the process has built the actor: not part of the interface, so never compared.
RAY_ADDED = ("_ray_trace_ctx",)


def shape(fn, drop: tuple[str, ...] = ()) -> tuple:
    """(parameters as (name, kind, default), resolved type hints) of a function, without `drop`."""
    drop = drop + RAY_ADDED
    params = [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values() if p.name not in drop]
    hints = {k: v for k, v in typing.get_type_hints(fn, localns=NAMES).items() if k not in drop}
    return params, hints


@pytest.mark.parametrize("serving,faults,actor", ACTORS, ids=["decode", "prefill"])
def test_each_actor_implements_its_two_protocols_exactly(serving, faults, actor):
    """The actor's public methods are the serving interface's and the fault interface's, nothing else;
    no method is in both."""
    served, faulted, offered = protocol_methods(serving), protocol_methods(faults), public_methods(actor)
    assert not set(served) & set(faulted), f"in both interfaces: {sorted(set(served) & set(faulted))}"
    declared = {**served, **faulted}
    assert set(offered) == set(declared), (f"actor and Protocols list different methods: only the actor "
                                           f"{sorted(set(offered) - set(declared))}, only the Protocols "
                                           f"{sorted(set(declared) - set(offered))}")
    for name, fn in declared.items():
        assert shape(offered[name]) == shape(fn), f"{actor.__name__}.{name} differs from {proto.__name__}.{name}"
        assert inspect.iscoroutinefunction(offered[name]) == inspect.iscoroutinefunction(fn), name


def test_the_router_client_calls_the_protocols_methods():
    """WorkerClient's methods are Protocol methods, with the same parameters and result, plus a timeout."""
    declared = {**protocol_methods(DecodeWorkerAPI), **protocol_methods(PrefillWorkerAPI)}
    client = public_methods(WorkerClient)
    assert client, "WorkerClient offers no worker method"
    for name, fn in client.items():
        assert name in declared, f"WorkerClient.{name} is no worker method"
        assert inspect.iscoroutinefunction(fn), name
        timeout = inspect.signature(fn).parameters["timeout"]
        assert timeout.kind is inspect.Parameter.KEYWORD_ONLY and timeout.default is None, name
        want_params, want_hints = shape(declared[name])
        got_params, got_hints = shape(fn, drop=("timeout",))
        assert got_params == want_params and got_hints == want_hints, f"WorkerClient.{name} differs from the Protocol"


def test_the_router_uses_every_client_method_and_calls_workers_only_through_them():
    """No dead client method; and no worker method the router calls outside WorkerClient."""
    sources = {p: p.read_text() for p in (ROOT / "router").rglob("*.py") if p.name != "worker_client.py"}
    text = "\n".join(sources.values())
    for name in public_methods(WorkerClient):
        assert re.search(rf"\.{name}\(", text), f"WorkerClient.{name} is never called in router/"
    assert ".call(" not in text and ".remote(" not in text


def test_the_router_never_calls_the_fault_interface():
    """No method of the fault interface is called (nor named) anywhere in router/, WorkerClient included."""
    faults = protocol_methods(DecodeFaultControl)
    assert {"inject_fault", "clear_faults", "inject_transport_fault", "check_blocks"} <= set(faults)
    for path in (ROOT / "router").rglob("*.py"):
        for name in faults:
            assert not re.search(rf"\b{name}\b", path.read_text()), f"{path.relative_to(ROOT)} names {name}"


def conforms(value, hint) -> bool:
    if hint is None or hint is type(None):
        return value is None
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return any(conforms(value, h) for h in typing.get_args(hint))
    origin = typing.get_origin(hint)
    return isinstance(value, origin or hint)


@pytest.fixture(scope="module")
def workers(demo_model_dir):
    spec = TransportSpec("local", namespace=f"worker-api-{uuid.uuid4().hex[:8]}", heartbeat_s=0.05)
    cfg = WorkerConfig(model_dir=str(demo_model_dir), dtype="float32", num_blocks=64, max_num_seqs=4)
    d = DecodeWorkerActor("d0", cfg, None)
    p = PrefillWorkerActor("p0", cfg)
    answers = None
    try:
        d.init_transport(spec)
        p.init_transport(spec)
        asyncio.run(p.connect_transport(["d0"]))
        # The prefill worker's client sends prompts to its dispatch socket and takes their answers on
        # the router's answer socket (the tests' empty secret).
        answers = PrefillAnswers("127.0.0.1", b"")
        yield WorkerClient("d0", "decode", d), WorkerClient("p0", "prefill", p, answers=answers), p
    finally:
        if answers is not None:
            answers.close()
        p.shutdown()
        d.shutdown()


def test_every_router_call_answers_the_declared_type(workers):
    dc, pc, p_actor = workers
    ray_pc = WorkerClient("p0", "prefill", p_actor)  # every prompt a call of `submit`
    declared = {**protocol_methods(DecodeWorkerAPI), **protocol_methods(PrefillWorkerAPI)}
    called: set[str] = set()

    def req(rid: str, n: int) -> GenerateRequest:
        return GenerateRequest(rid, tuple(range(5, 5 + n)), SamplingParams(max_tokens=4, temperature=0.0), 0, 0.0)

    async def check(client: WorkerClient, name: str, *args):
        result = await getattr(client, name)(*args, timeout=30.0)
        want = typing.get_type_hints(declared[name], localns=NAMES)["return"]
        assert conforms(result, want), f"{client.role}.{name} answered {result!r}, declared {want}"
        called.add(name)
        return result

    async def main():
        for c in (dc, pc):
            assert (await check(c, "stats")).role == c.role
            await check(c, "kv_events", None, 0)
        for client, rid in ((pc, "remote"), (ray_pc, "remote-ray")):
            remote = req(rid, 40)
            # As the router's walk does: the prompt goes out at once, D's reservation follows to P.
            submitted = asyncio.ensure_future(check(client, "submit", PrefillTask(remote)))
            await asyncio.sleep(0)  # the submit goes out first (these in-process calls run when awaited)
            res = await check(dc, "reserve", ReserveRequest(remote, "p0"))
            assert res is not None
            await check(client, "attach", rid, res)
            result = await submitted
            assert result.ok and result.request_id == rid, result
        assert p_actor.dispatch.received == 1  # the first as a frame (its stats named the socket), the second not
        assert await check(dc, "submit_local", req("local", 10)) is not None
        assert await check(dc, "lost", "local") is False
        await check(dc, "fail", "remote", "a test")  # ends its stream with that error, not an abort
        for c in (dc, pc):
            await check(c, "abort", "local")
            await check(c, "peer_died", "nobody", "a test")  # an unknown peer: nothing to drop

    asyncio.run(main())
    assert called == set(public_methods(WorkerClient))  # every method the router uses was called
