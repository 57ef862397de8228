"""Migrator, through the Router (no Ray, no model): a request whose worker failed it is placed again
as prompt + the tokens its client already has, or ended with the reason why not. The workers are
router_fakes.StubWorker."""

from __future__ import annotations

import asyncio

from ray.exceptions import RayActorError

from cluster.wire.messages import GenerateRequest
from cluster.sampling.sampling_params import SamplingParams
from router.requests.admission import AdmissionController, AdmissionLimits
from router.router import Router
from router.router_config import RouterConfig
from router.workers.worker_client import WorkerClient
from router_fakes import StubWorker


def make_router(prefill=(), decode=(), **cfg) -> tuple[Router, list[tuple[str, str]]]:
    notified = []
    router = Router([WorkerClient(w.worker_id, "prefill", w) for w in prefill],
                    [WorkerClient(w.worker_id, "decode", w) for w in decode],
                    AdmissionController(AdmissionLimits(max_model_len=4096, block_size=16)),
                    RouterConfig(**{"stats_interval_s": 0.01, "reserve_wait_s": 0.1, "migration_wait_s": 0.2,
                                    "prefill_placement": "static", **cfg}),
                    notify=lambda rs, error: notified.append((rs.request_id, error)))
    return router, notified


def request(rid="r1", max_tokens=10) -> GenerateRequest:
    return GenerateRequest(rid, (5, 6, 7), SamplingParams(max_tokens=max_tokens, min_tokens=min(4, max_tokens), temperature=0.7), 42, 0.0)


def test_a_dead_decode_workers_request_continues_elsewhere_with_its_tokens():
    async def main():
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        router, notified = make_router(decode=[d0, d1], unhealthy_after_failures=1)
        await router.start()
        rs = await router.submit(request())
        assert rs.decode_worker_id == "d0"
        d0.fail = RayActorError()
        await router.poll_once()
        assert notified == [("r1", "decode worker d0 died")] and rs.lost
        assert await router.migrate("r1", "r1.m1", (11, 12, 13), 9, notified[0][1]) is None
        assert rs.decode_worker_id == "d1" and rs.migrations == 1 and rs.lost is None
        moved = [c[1] for c in d1.calls if c[0] == "submit_local"][-1]
        assert moved.request_id == "r1.m1" and moved.prompt_token_ids == (5, 6, 7, 11, 12, 13)
        assert (moved.params.max_tokens, moved.params.min_tokens, moved.seed) == (7, 1, 42)  # same seed
        assert (moved.resumed_tokens, moved.resumed_chars) == (3, 9)
        assert rs.request_id == "r1" and rs.worker_request_id == "r1.m1"
        router.finish("r1")
        await router.stop()
    asyncio.run(main())


def test_why_a_request_is_not_moved():
    async def main():
        d0, d1 = StubWorker("d0", "decode"), StubWorker("d1", "decode")
        router, _ = make_router(decode=[d0, d1], max_migrations=1)
        await router.start()
        assert await router.migrate("nobody", "nobody.m1", (), 0, "boom") == ("error", "boom")
        rs = await router.submit(request(max_tokens=3))
        # Its worker is fine and did not lose it: the failure is the request's own.
        assert await router.migrate("r1", "r1.m1", (1,), 1, "bad request") == ("error", "bad request")
        rs.lost = "decode worker d0 died"
        assert await router.migrate("r1", "r1.m1", (1, 2, 3), 3, "x") == ("length", None)  # nothing left to make
        rs.lost = "decode worker d0 died"
        assert await router.migrate("r1", "r1.m1", (1,), 1, "x") is None
        rs.lost = "decode worker d1 died"
        end = await router.migrate("r1", "r1.m2", (1, 2), 2, "x")
        assert end == ("error", "decode worker d1 died; not migrated again after 1 moves")
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_with_migration_off_a_dead_workers_request_ends_with_its_error():
    async def main():
        d0, d1 = StubWorker("d0", "decode"), StubWorker("d1", "decode")
        router, notified = make_router(decode=[d0, d1], migrate_on_worker_death=False)
        await router.start()
        await router.submit(request())
        d0.fail = RayActorError()
        await router.poll_once()
        assert await router.migrate("r1", "r1.m1", (1,), 1, notified[0][1]) == ("error", "decode worker d0 died")
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_a_request_its_live_worker_lost_is_moved_like_a_dead_workers():
    async def main():
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        router, _ = make_router(decode=[d0, d1])
        await router.start()
        rs = await router.submit(request())
        d0.lost_ids.add("r1")  # its decode loop failed; the process lives on
        d0.refuse = True  # (and it takes nothing new)
        assert await router.migrate("r1", "r1.m1", (1,), 1, "decode loop failed") is None
        assert rs.decode_worker_id == "d1" and ("lost", "r1") in d0.calls
        await asyncio.sleep(0.05)  # the abort goes out in the background
        assert ("abort", "r1") in d0.calls  # what was left of it there is dropped
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_a_prompt_whose_prefill_worker_died_is_placed_again():
    async def main():
        p0, d0 = StubWorker("p0", "prefill"), StubWorker("d0", "decode")
        router, _ = make_router(prefill=[p0], decode=[d0])
        await router.start()
        rs = await router.submit(request())
        assert rs.prefill_worker_id == "p0"
        p0.fail = RayActorError()  # the decode side saw the transfer break before the router saw P die
        assert await router.migrate("r1", "r1.m1", (), 0, "transfer failed") is None
        assert rs.local_prefill and rs.decode_worker_id == "d0" and rs.prefill_worker_id is None  # no P left
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_a_failure_seen_before_the_decode_workers_restart_is_a_death():
    """The decode worker restarted (a new incarnation answers) before the router noticed, and the
    request's failure reaches it first (a transfer to the dead incarnation broke): a poll now finds
    the restart, and the request moves, instead of being failed because the new incarnation does not
    know it (lost() False)."""
    async def main():
        d0, d1 = StubWorker("d0", "decode", free_blocks=100), StubWorker("d1", "decode", free_blocks=90)
        router, _ = make_router(decode=[d0, d1])
        await router.start()
        rs = await router.submit(request())
        assert rs.decode_worker_id == "d0"
        d0.incarnation = "i1"  # restarted between two polls; it knows nothing of r1
        assert await router.migrate("r1", "r1.m1", (11,), 2, "KV transfer failed") is None
        assert rs.decode_worker_id == "d1" and rs.migrations == 1
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


async def _started_one_pair_router():
    """A started router over one prefill and one decode worker, every prompt prefilled remotely; and a
    40-token request."""
    p0 = StubWorker("p0", "prefill")
    d0 = StubWorker("d0", "decode", free_blocks=100)
    router, notified = make_router(prefill=[p0], decode=[d0], local_prefill_threshold=0)
    await router.start()
    req = GenerateRequest("r1", tuple(range(5, 45)), SamplingParams(max_tokens=10, temperature=0.0), 1, 0.0)
    return router, notified, p0, req


def test_a_request_whose_transfer_failed_is_not_placed_on_that_pair_again():
    async def main():
        router, notified, p0, req = await _started_one_pair_router()
        p0.prefill_ok = False  # the prompt's computation / transfer fails
        rs = await router.submit(req)
        assert rs.prefill_worker_id == "p0"
        for _ in range(100):
            if notified:
                break
            await asyncio.sleep(0.01)
        assert notified and rs.lost  # a failure of the cluster: it moves
        assert await router.migrate("r1", "r1.m1", (), 0, notified[0][1]) is None
        assert rs.local_prefill and rs.prefill_worker_id is None and ("p0", "d0") in rs.avoid_pairs
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_a_migrated_request_whose_new_transfer_fails_avoids_that_pair_too():
    """A request moved with tokens so far is prefilled again (prompt + those tokens); when that
    placement's transfer fails before it made a token of its own, its pair is avoided as well,
    rather than placed through it again until max_migrations runs out."""
    async def main():
        router, notified, p0, req = await _started_one_pair_router()
        rs = await router.submit(req)
        assert rs.prefill_worker_id == "p0"
        rs.lost = "decode worker d0 died"  # it had made two tokens on d0
        assert await router.migrate("r1", "r1.m1", (11, 12), 2, rs.lost) is None
        # A decode worker's death after tokens of its own: the pair is not to blame.
        assert rs.prefill_worker_id == "p0" and rs.request.resumed_tokens == 2 and not rs.avoid_pairs
        rs.lost = "decode worker d0 died"  # again, after a third token
        p0.prefill_ok = False  # from now on, the pair's transfers fail
        assert await router.migrate("r1", "r1.m2", (11, 12, 13), 3, rs.lost) is None
        assert rs.prefill_worker_id == "p0" and rs.request.resumed_tokens == 3
        for _ in range(100):
            if notified:
                break
            await asyncio.sleep(0.01)
        assert notified and rs.lost  # the new placement's transfer failed: a failure of the cluster
        assert await router.migrate("r1", "r1.m3", (11, 12, 13), 3, notified[-1][1]) is None
        assert rs.local_prefill and rs.prefill_worker_id is None and ("p0", "d0") in rs.avoid_pairs
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())


def test_a_transfer_that_failed_after_the_first_token_was_sent_avoids_that_pair():
    """The prefill worker sends the first token to the gateway before its KV commit: when the
    transfer then fails, the client already has that token and the migration carries it, yet the
    placement's pair failed and is avoided (before, the token counted as the placement's own, and a
    wedged pair took the request back until max_migrations ran out: chaos "stuck_transfer")."""
    async def main():
        router, notified, p0, req = await _started_one_pair_router()
        p0.prefill_ok = False
        rs = await router.submit(req)
        for _ in range(100):
            if notified:
                break
            await asyncio.sleep(0.01)
        assert notified and rs.lost
        assert await router.migrate("r1", "r1.m1", (11,), 1, notified[0][1]) is None
        assert rs.local_prefill and rs.prefill_worker_id is None and ("p0", "d0") in rs.avoid_pairs
        assert rs.request.resumed_tokens == 1
        router.finish("r1", abort=True)
        await router.stop()
    asyncio.run(main())
