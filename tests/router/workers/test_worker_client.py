"""WorkerClient: one typed call each, on a plain object (sync or async methods) and on a Ray-like
handle (`method.remote(...)` returns an awaitable), under its timeout. That its methods are the
worker interface's: tests/cluster/test_worker_api.py."""

from __future__ import annotations

import asyncio

import pytest

from cluster.wire.messages import WorkerStats
from router.workers.worker_client import WorkerClient


class Plain:
    def stats(self):
        return WorkerStats("w", "decode")

    async def lost(self, request_id):
        await asyncio.sleep(0.2)
        return True


class RemoteMethod:
    """What a Ray actor handle's attribute looks like: `.remote(*args)` gives an awaitable."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return asyncio.ensure_future(self.fn(*args))


class RayLike:
    def __init__(self):
        self.got = []

        async def abort(request_id):
            self.got.append(request_id)

        async def kv_events(epoch, seq):
            return (epoch, seq)
        self.abort, self.kv_events = RemoteMethod(abort), RemoteMethod(kv_events)


def test_calls_on_plain_and_ray_like_handles():
    async def main():
        plain = WorkerClient("w", "decode", Plain())
        assert (await plain.stats(timeout=1.0)).worker_id == "w"  # a sync method answers at once
        assert await plain.lost("r", timeout=1.0) is True
        with pytest.raises(TimeoutError):
            await plain.lost("r", timeout=0.05)
        assert await plain.lost("r") is True  # no timeout: waits
        ray_like = RayLike()
        client = WorkerClient("w", "decode", ray_like)
        await client.abort("r1", timeout=1.0)
        assert ray_like.got == ["r1"] and await client.kv_events("e", 3, timeout=1.0) == ("e", 3)
        with pytest.raises(AttributeError):  # a method the handle lacks
            await client.reserve(None, timeout=1.0)
    asyncio.run(main())
