"""Chaos under load: greedy streams kept going while a fault injector breaks the cluster every few
seconds, one fault of a random kind at a time. Writes one JSON file of figures; RELIABILITY.md has them
as a table.

    python -m benchmarks.chaos --duration-s 600 --interval-s 15 --out loadtest/results/chaos_cpu.json

Fault kinds (`--faults`, all by default; each drawn only where it applies):
- `prefill`, `decode`: a worker's process killed (`ray.kill(no_restart=False)`: Ray restarts its actor,
  which rejoins). A decode worker only while another one is healthy (new requests get 503 while none
  is, which is the admission rule, not a failure of the restarts under test).
- `transfer`: one KV transfer's pair (not a worker) killed mid-payload (its first layer out, the rest
  never comes: the prefill worker tears its channel down, ControlledTransport.inject_fault); the
  requests it carried are placed again, the pair is formed anew.
- `stuck_transfer`: one KV transfer whose payload never completes (the pair's channel wedges): both
  sides give up at transfer_timeout_s, the decode worker frees its blocks and its batch slot.
- `cancel_storm`: 64 concurrent long-prompt streams cancelled at random points (in the admission
  queue, mid-prefill, mid-transfer, mid-decode), four times in a row; then a probe request must be
  served at once (`probe_ttft_s`).
- `rejoin_peer_death`: the prefill worker restarted while a decode worker takes its time to form the
  pair with it ("slow_hello"), and that decode worker killed meanwhile: the rejoin must fail that pair
  at once and finish with the others (before the fix it waited for the rendezvous' timeout).
- `simultaneous_restart`: a prefill and a decode worker killed together: both rejoin, and their pair
  is formed in the rejoin (`pair_formed`), not left for the first transfer.
- `restart_limit`: last, a decode worker killed past its restart limit (for good): the cluster serves
  on the other, /ready answers 200 naming it in `workers_gone`, `pdserve:worker_gone` is 1.

What it checks (and counts): every request ends within `--deadline-s` (else: hung), with HTTP 200
and no error event, and its text equals the reference engine's greedy text; per fault kind the
requests it affected, how many of those finished exactly, hung or got an error, and seconds until the
cluster was whole again (a worker back and rejoined, a pair formed anew, a stuck transfer's blocks
free); after the load, seconds until every live worker holds every KV block free, and the blocks still
held (leaked), plus each worker's block accounting check. Runs the cluster in-process (the router on
a thread, as the tests do) to see the router's view of who holds what; on CPU with the demo model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

MODEL = "pdserve-demo"
KINDS = ("prefill", "decode", "transfer", "stuck_transfer", "cancel_storm", "rejoin_peer_death",
         "simultaneous_restart", "restart_limit")
log = logging.getLogger("chaos")


@dataclass
class Outcome:
    """One request as the client saw it."""

    prompt: int
    request_id: str | None = None
    status: int = 0
    text: str = ""
    error: str | None = None
    hung: bool = False
    exact: bool = False
    start: float = 0.0
    end: float = 0.0


@dataclass
class Fault:
    t: float  # seconds since the load started
    kind: str  # one of KINDS
    worker: str  # the victim (the prefill worker of a transfer fault; "a+b" for two)
    affected: list[str] = field(default_factory=list)  # request ids of the load it hit
    back_s: float | None = None  # the fault -> the cluster whole again (None: not within the deadline)
    in_transfer: int = 0  # (worker kills) remote prefills not landed yet: KV on the wire or being computed
    extra: dict = field(default_factory=dict)


def prompts(n: int, long_words: int = 30) -> list[str]:
    """Short prompts (prefilled on their decode worker) and long ones (prefilled remotely), alternating."""
    return [f"Chaos {i}: " + " ".join(f"w{(i * 7 + k) % 50}" for k in range(4 if i % 2 else long_words))
            for i in range(n)]


def storm_prompt(i: int, words: int = 540) -> str:
    """About 1.5k tokens of the demo tokenizer."""
    return f"Storm {i}: " + " ".join(f"w{(i * 11 + k) % 40}" for k in range(words))


async def _one(client: httpx.AsyncClient, i: int, prompt: str, ref: str, max_tokens: int, deadline_s: float) -> Outcome:
    o = Outcome(i, start=time.monotonic())
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", "/v1/completions", json=body) as r:
                o.status = r.status_code
                if r.status_code != 200:
                    o.error = (await r.aread()).decode(errors="replace")[:200]
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        ev = json.loads(line[6:])
                        o.request_id = o.request_id or ev.get("id")
                        if "error" in ev:
                            o.error = ev["error"].get("message", str(ev["error"]))
                        elif ev.get("choices"):
                            o.text += ev["choices"][0].get("text") or ""
    except TimeoutError:
        o.hung = True
    except httpx.HTTPError as e:
        o.error = f"{type(e).__name__}: {e}"
    o.end = time.monotonic()
    o.exact = o.status == 200 and o.error is None and not o.hung and o.text == ref
    return o


class Injector:
    """The faults, each a coroutine on the test's loop that returns its Fault once it is injected
    (what takes longer, a worker coming back, is watched in the background: `watchers`)."""

    def __init__(self, sc, t0: float, deadline_s: float, rng: random.Random, sole_decode_kills: bool, url: str):
        self.sc, self.router, self.t0, self.deadline_s, self.rng = sc, sc.router, t0, deadline_s, rng
        self.sole_decode_kills, self.url = sole_decode_kills, url
        self.watchers: list[asyncio.Future] = []
        self.storm_stats: list[dict] = []

    # -- helpers ----------------------------------------------------------------------------------
    def _handle(self, wid: str):
        return {**self.sc.workers.prefill, **self.sc.workers.decode}[wid]

    def _healthy(self, role: str) -> list[str]:
        ids = self.router.prefill_ids if role == "prefill" else self.router.decode_ids
        return [w for w in ids if self.router.views[w].healthy]

    def _fault(self, kind: str, worker: str, affected=(), **extra) -> Fault:
        return Fault(round(time.monotonic() - self.t0, 2), kind, worker, sorted(set(affected)), extra=extra)

    async def _ray(self, ref, timeout: float = 30.0):
        import ray

        return await asyncio.get_running_loop().run_in_executor(None, lambda: ray.get(ref, timeout=timeout))

    def _watch(self, f: Fault, done, started: float) -> None:
        async def watch():
            while not await done():
                if time.monotonic() - started > self.deadline_s:
                    return
                await asyncio.sleep(0.05)
            f.back_s = round(time.monotonic() - started, 2)
        self.watchers.append(asyncio.ensure_future(watch()))

    def _back(self, wid: str, old: str | None):
        async def done():
            return self.router.incarnation(wid) != old and self.router.views[wid].healthy
        return done

    def _kill(self, wid: str) -> tuple[list[str], int, str | None]:
        import ray

        held = sorted(self.router.views[wid].inflight)
        placed = [self.router.inflight.get(r) for r in held]
        in_transfer = sum(1 for rs in placed if rs is not None and not rs.local_prefill and not rs.prefill_done)
        old = self.router.incarnation(wid)
        ray.kill(self._handle(wid), no_restart=False)
        return held, in_transfer, old

    def applicable(self, kinds) -> list[str]:
        hp, hd = self._healthy("prefill"), self._healthy("decode")
        all_up = len(hp) == len(self.router.prefill_ids) and len(hd) == len(self.router.decode_ids)
        ok = {"prefill": bool(hp), "decode": len(hd) >= (1 if self.sole_decode_kills else 2),
              "transfer": bool(hp and hd), "stuck_transfer": bool(hp and hd), "cancel_storm": bool(hd),
              "rejoin_peer_death": all_up and len(hd) >= 2 and bool(hp),
              "simultaneous_restart": all_up and len(hd) >= 2 and bool(hp)}
        return [k for k in kinds if ok.get(k)]

    # -- the faults -------------------------------------------------------------------------------
    async def kill(self, role: str) -> Fault:
        wid = self.rng.choice(self._healthy(role))
        held, in_transfer, old = self._kill(wid)
        f = self._fault(role, wid, held)
        f.in_transfer = in_transfer
        self._watch(f, self._back(wid, old), time.monotonic())
        return f

    async def transfer(self, kind: str) -> Fault:
        """Arms the prefill worker's next bundle; waits until it fired; affected: the transfers that
        failed with it; back: its pair formed anew (the next generation), counted from when it fired
        (the wait for the load's next remote prefill is not the fault's)."""
        pid = self.rng.choice(self._healthy("prefill"))
        h = self._handle(pid)
        before = await self._ray(h.transfer_metrics.remote())
        started = time.monotonic()
        await self._ray(h.inject_transport_fault.remote(kind))
        while True:  # fires with the next remote prefill of the load
            m = await self._ray(h.transfer_metrics.remote())
            if m.get("faults_fired", 0) > before.get("faults_fired", 0) or time.monotonic() - started > 60:
                break
            await asyncio.sleep(0.05)
        fired_at = time.monotonic()
        f = self._fault(kind, pid)
        f.extra["fired"] = m.get("faults_fired", 0) > before.get("faults_fired", 0)
        hit = m["fired"][-1] if f.extra["fired"] else {}  # the pair it broke: {"peer", "gen"}
        f.extra["pair"] = hit

        async def reformed():
            m = await self._ray(h.transfer_metrics.remote())
            failed = m["failures"] - before["failures"]
            if failed and not f.affected:
                f.affected = sorted({re.sub(r"\.m\d+$", "", r["request_id"]) for r in m["recent"][-failed:]
                                     if not r["ok"]})
            pair = m["pairs"].get(hit.get("peer"))
            return failed > 0 and pair is not None and pair["gen"] > hit["gen"] and pair["dead"] is None
        self._watch(f, reformed, fired_at)
        return f

    async def cancel_storm(self, rounds: int = 4, n: int = 64) -> Fault:
        """`rounds` x `n` concurrent long-prompt streams, each cancelled after a random delay, then a
        probe; back: the probe's first token (served at once: nothing is left holding capacity)."""
        f = self._fault("cancel_storm", "all")
        started = time.monotonic()
        limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as c:
            async def one(i: int):
                body = {"model": MODEL, "prompt": storm_prompt(i), "max_tokens": 64, "ignore_eos": True, "stream": True}
                try:
                    async with asyncio.timeout(self.rng.uniform(0.05, 2.5)):
                        async with c.stream("POST", "/v1/completions", json=body) as r:
                            async for _ in r.aiter_lines():
                                pass
                    return "finished"
                except TimeoutError:
                    return "cancelled"
            ends = []
            for k in range(rounds):
                ends += await asyncio.gather(*(one(k * n + i) for i in range(n)))
            t_probe = time.monotonic()
            probe = {"model": MODEL, "prompt": "Probe: w1 w2 w3", "max_tokens": 4, "stream": True}
            ttft = None
            async with c.stream("POST", "/v1/completions", json=probe) as r:
                status = r.status_code
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and ttft is None:
                        ttft = time.monotonic() - t_probe
        f.extra.update(cancelled=ends.count("cancelled"), finished=ends.count("finished"), probe_status=status,
                       probe_ttft_s=None if ttft is None else round(ttft, 3), storm_s=round(t_probe - started, 1))
        f.back_s = f.extra["probe_ttft_s"]
        return f

    async def rejoin_peer_death(self) -> tuple[Fault, Fault]:
        """The prefill worker restarted; a decode worker delays their pair ("slow_hello", 20 s) and is
        killed while the prefill's rejoin waits for it. back: the prefill rejoined (the decode
        worker's own kill is a second Fault, of kind "decode")."""
        pid = self.rng.choice(self._healthy("prefill"))
        did = sorted(self._healthy("decode"))[-1]  # the prefill forms its pairs in id order: this one last
        await self._ray(self._handle(did).inject_transport_fault.remote("slow_hello", 20.0))
        held, in_transfer, old = self._kill(pid)
        f = self._fault("rejoin_peer_death", f"{pid}+{did}", held)
        f.in_transfer = in_transfer
        started = time.monotonic()
        health = self.router.health
        while pid not in health._rejoining and time.monotonic() - started < self.deadline_s:
            await asyncio.sleep(0.02)  # its new incarnation answers and its rejoin begins
        await asyncio.sleep(1.0)  # the pair with `did` is forming (slowly)
        f.extra["killed_while_rejoining"] = pid in health._rejoining
        held_d, _, old_d = self._kill(did)
        f.affected = sorted(set(f.affected) | set(held_d))
        t_kill = time.monotonic()
        back_p = self._back(pid, old)

        async def back():
            if await back_p():
                f.extra.setdefault("rejoined_after_the_peer_died_s", round(time.monotonic() - t_kill, 2))
                return True
            return False
        self._watch(f, back, started)
        g = self._fault("decode", did, held_d)  # the decode worker's own kill, counted with the decode kills
        self._watch(g, self._back(did, old_d), t_kill)
        return f, g

    async def simultaneous_restart(self) -> Fault:
        pid = self.rng.choice(self._healthy("prefill"))
        did = self.rng.choice(self._healthy("decode"))
        hp, ip, oldp = self._kill(pid)
        hd, idd, oldd = self._kill(did)
        f = self._fault("simultaneous_restart", f"{pid}+{did}", hp + hd)
        f.in_transfer = ip + idd
        h = self._handle(pid)
        back_p, back_d = self._back(pid, oldp), self._back(did, oldd)

        async def both_back():
            if not (await back_p() and await back_d()):
                return False
            m = await self._ray(h.transfer_metrics.remote())
            pair = m.get("pairs", {}).get(did)
            f.extra["pair_formed"] = pair is not None and pair["dead"] is None
            return True
        self._watch(f, both_back, time.monotonic())
        return f

    async def restart_limit(self) -> Fault:
        """A decode worker dies for good (past its restart limit); the other serves on."""
        import ray

        did = sorted(self._healthy("decode"))[-1]
        held = sorted(self.router.views[did].inflight)
        ray.kill(self._handle(did), no_restart=True)
        f = self._fault("restart_limit", did, held)
        started = time.monotonic()

        async def said_so():
            if did not in self.router.health.gone:
                return False
            async with httpx.AsyncClient(base_url=self.url, timeout=10) as c:
                ready = await c.get("/ready")
                metrics = (await c.get("/metrics")).text
                probe = await c.post("/v1/completions",
                                     json={"model": MODEL, "prompt": "After: w1 w2", "max_tokens": 4})
            gone = re.search(rf'pdserve:worker_gone\{{[^}}]*worker_id="{did}"[^}}]*\}} 1\.0', metrics) is not None
            f.extra.update(ready_status=ready.status_code, ready_body=ready.json(), metric_worker_gone=gone,
                           served_after=probe.status_code)
            return ready.status_code == 200 and did in ready.json().get("workers_gone", []) and gone
        self._watch(f, said_so, started)
        return f


async def run_load(sc, refs: dict[str, str], *, duration_s: float, interval_s: float, streams: int,
                   max_tokens: int, deadline_s: float, seed: int = 0, sole_decode_kills: bool = False,
                   faults=("prefill", "decode"), faults_wanted: int | None = None) -> tuple[list[Outcome], list[Fault]]:
    """`streams` clients each send one greedy request after another for `duration_s` while a fault of
    a random kind in `faults` is injected every `interval_s` ("restart_limit" once, at the end);
    returns every request's outcome and every fault.
    sole_decode_kills: a decode worker may be killed while it is the only healthy one (a 1P+1D
    cluster on two GPUs): its requests wait for its restart, and new ones get 503 meanwhile.
    faults_wanted: the load ends once that many faults were made and every victim is back (or its
    watch gave up); `duration_s` then only bounds it, and the first fault goes once the load runs
    (`streams` requests answered), not `interval_s` after the start (the tests: events, not clocks)."""
    rng = random.Random(seed)
    texts = list(refs)
    outcomes: list[Outcome] = []
    found: list[Fault] = []
    t0 = time.monotonic()
    stop = t0 + duration_s
    inj = Injector(sc, t0, deadline_s, rng, sole_decode_kills, sc.url)
    kinds = [k for k in faults if k != "restart_limit"]
    enough = asyncio.Event()  # faults_wanted made and watched to their end

    async def client_loop(k: int, client: httpx.AsyncClient):
        i = k
        while time.monotonic() < stop and not enough.is_set():
            p = texts[i % len(texts)]
            outcomes.append(await _one(client, i % len(texts), p, refs[p], max_tokens, deadline_s))
            i += streams

    async def load_running() -> None:
        # The first fault of a bounded run (faults_wanted) goes as soon as the load runs: every stream
        # has had a request answered on average (the clients keep one in flight each), `interval_s`
        # at most. An event, not a clock: the tests wait for the load, not for a fixed head start.
        t = time.monotonic()
        while len(outcomes) < streams and time.monotonic() - t < interval_s:
            await asyncio.sleep(0.05)

    async def injector():
        while faults_wanted is None or len(found) < faults_wanted:
            if faults_wanted is not None and not found:
                await load_running()
            else:
                await asyncio.sleep(interval_s)
            if time.monotonic() >= stop - (interval_s if "restart_limit" in faults else 0):
                break
            choices = inj.applicable(kinds)
            if not choices:
                if not kinds and faults_wanted is not None:
                    break  # restart_limit alone: made now, not at the end of the bound
                continue
            kind = rng.choice(choices)
            try:
                if kind in ("prefill", "decode"):
                    made = await inj.kill(kind)
                elif kind in ("transfer", "stuck_transfer"):
                    made = await inj.transfer(kind)
                elif kind == "cancel_storm":
                    made = await inj.cancel_storm()
                elif kind == "rejoin_peer_death":
                    made = await inj.rejoin_peer_death()
                else:
                    made = await inj.simultaneous_restart()
            except Exception:  # noqa: BLE001 - a fault that could not be made is reported, the run goes on
                log.exception("injecting %s failed", kind)
                continue
            for f in made if isinstance(made, tuple) else (made,):
                found.append(f)
                log.warning("t=%.1fs %s on %s (%d requests of the load on it)", f.t, f.kind, f.worker, len(f.affected))
        if "restart_limit" in faults and len([w for w in sc.router.decode_ids if sc.router.views[w].healthy]) >= 2 \
                and (faults_wanted is None or len(found) < faults_wanted):
            found.append(await inj.restart_limit())
        if faults_wanted is not None and len(found) >= faults_wanted:
            if inj.watchers:  # a cancel storm has no victim to watch
                await asyncio.wait(inj.watchers, timeout=deadline_s)
            enough.set()

    async with httpx.AsyncClient(base_url=sc.url, timeout=None, limits=httpx.Limits(max_connections=streams + 8)) as c:
        task = asyncio.ensure_future(injector())
        await asyncio.gather(*(client_loop(k, c) for k in range(streams)))
        await task
        if inj.watchers:  # every victim back (bounded: a worker that never returns is reported as such)
            await asyncio.wait(inj.watchers, timeout=deadline_s)
            for w in inj.watchers:
                w.cancel()
    return outcomes, found


def settle(sc, timeout_s: float) -> tuple[float | None, dict[str, int]]:
    """Waits until every worker (but those gone for good) answers with all its KV blocks free and
    nothing running; returns the seconds that took (None: not within `timeout_s`) and the blocks each
    worker still held at the end."""
    import ray

    t0 = time.monotonic()
    gone = set(sc.router.health.gone)
    handles = {w: h for w, h in {**sc.workers.prefill, **sc.workers.decode}.items() if w not in gone}
    while True:
        held = {}
        for wid, h in handles.items():
            try:
                s = ray.get(h.stats.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - not back yet
                held[wid] = -1
                continue
            held[wid] = s.total_blocks - s.free_blocks + s.running + s.waiting
        if all(v == 0 for v in held.values()):
            ray.get([h.check_blocks.remote() for h in handles.values()], timeout=30)
            return time.monotonic() - t0, held
        if time.monotonic() - t0 > timeout_s:
            return None, held
        time.sleep(0.1)


def summarize(outcomes: list[Outcome], faults: list[Fault], settle_s: float | None, held: dict[str, int]) -> dict:
    by_id = {o.request_id: o for o in outcomes if o.request_id}
    kinds = {}
    for kind in KINDS:
        fs = [f for f in faults if f.kind == kind]
        if not fs:
            continue
        affected = [by_id[r] for f in fs for r in f.affected if r in by_id]
        backs = [f.back_s for f in fs if f.back_s is not None]
        kinds[kind] = dict(
            injected=len(fs), requests_affected=sum(len(f.affected) for f in fs),
            with_kv_in_flight=sum(f.in_transfer for f in fs), kills_mid_transfer=sum(f.in_transfer > 0 for f in fs),
            finished_exactly=sum(o.exact for o in affected), hung=sum(o.hung for o in affected),
            errors_returned=sum(o.error is not None for o in affected),
            http_5xx=sum(o.status >= 500 for o in affected),
            not_back=sum(f.back_s is None for f in fs),
            seconds_to_recover_max=round(max(backs), 2) if backs else None,
            seconds_to_recover_mean=round(sum(backs) / len(backs), 2) if backs else None)
    leaked = sum(v for v in held.values() if v > 0)
    return dict(
        requests=len(outcomes), finished_exactly=sum(o.exact for o in outcomes),
        mismatched=sum(o.status == 200 and o.error is None and not o.hung and not o.exact for o in outcomes),
        hung=sum(o.hung for o in outcomes), errors_returned=sum(o.error is not None for o in outcomes),
        http_5xx=sum(o.status >= 500 for o in outcomes), http_4xx=sum(400 <= o.status < 500 for o in outcomes),
        blocks_leaked=leaked, workers_not_answering=[w for w, v in held.items() if v < 0],
        seconds_to_full_capacity_after_load=None if settle_s is None else round(settle_s, 2),
        by_fault=kinds)


def run(sc, engine, *, duration_s: float, interval_s: float, streams: int = 8, max_tokens: int = 24,
        deadline_s: float = 120.0, settle_s: float = 120.0, n_prompts: int = 16, seed: int = 0,
        long_words: int = 30, sole_decode_kills: bool = False, faults=("prefill", "decode"),
        faults_wanted: int | None = None) -> dict:
    """The whole experiment on a started cluster `sc` (ServingCluster, router in-process) against the
    reference `engine` (cluster.engine.engine.LLMEngine on the same checkpoint)."""
    from cluster.sampling.sampling_params import SamplingParams

    ps = prompts(n_prompts, long_words)
    refs = {p: r.text for p, r in zip(ps, engine.generate(
        ps, [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)] * len(ps)))}
    t0 = time.monotonic()
    outcomes, found = asyncio.run(run_load(sc, refs, duration_s=duration_s, interval_s=interval_s,
                                           streams=streams, max_tokens=max_tokens, deadline_s=deadline_s, seed=seed,
                                           sole_decode_kills=sole_decode_kills, faults=tuple(faults),
                                           faults_wanted=faults_wanted))
    load_s = time.monotonic() - t0
    took, held = settle(sc, settle_s)
    summary = summarize(outcomes, found, took, held)
    bad = [asdict(o) for o in outcomes if not o.exact][:20]
    return dict(config=dict(duration_s=duration_s, interval_s=interval_s, streams=streams, max_tokens=max_tokens,
                            deadline_s=deadline_s, seed=seed, long_words=long_words, faults=list(faults),
                            faults_wanted=faults_wanted,
                            sole_decode_kills=sole_decode_kills, device=sc.cfg.device,
                            kv_transport=sc.cfg.kv_transport, prefill_workers=len(sc.workers.prefill),
                            decode_workers=len(sc.workers.decode), worker_max_restarts=sc.cfg.worker_max_restarts,
                            cpu_num_blocks=sc.cfg.cpu_num_blocks),
                load_s=round(load_s, 1), summary=summary, faults=[asdict(f) for f in found], not_exact=bad)


def chaos_transport_group(transfer_timeout_s: float):
    """The launcher's KV transport group with a shorter transfer_timeout_s (a stuck transfer's blocks
    come back after it; the default is 30 s)."""
    from deploy.kv_transport_group import form_kv_transport_group

    def form(prefill, decode, cfg, **where):
        return form_kv_transport_group(prefill, decode, cfg, **where, transfer_timeout_s=transfer_timeout_s)
    return form


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration-s", type=float, default=300.0, help="how long the load and the faults run")
    ap.add_argument("--interval-s", type=float, default=10.0, help="seconds between two faults")
    ap.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated fault kinds, of {','.join(KINDS)}")
    ap.add_argument("--streams", type=int, default=8, help="concurrent greedy streams")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--deadline-s", type=float, default=120.0, help="a request still running after this hung")
    ap.add_argument("--prefill-workers", type=int, default=1)
    ap.add_argument("--decode-workers", type=int, default=2)
    ap.add_argument("--model", default=None, help="model directory (default: the demo model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="model dtype (default: the checkpoint's)")
    ap.add_argument("--gpus-per-worker", type=float, default=None, help="1: each worker its own GPU (KV over NCCL)")
    ap.add_argument("--kv-memory-fraction", type=float, default=0.5)
    ap.add_argument("--cpu-num-blocks", type=int, default=1024, help="KV blocks per worker on CPU")
    ap.add_argument("--transfer-timeout-s", type=float, default=5.0, help="the KV transport's transfer_timeout_s")
    ap.add_argument("--long-prompt-words", type=int, default=30,
                    help="words of the long prompts (prefilled remotely; long ones ship layer-wise)")
    ap.add_argument("--sole-decode-kills", action="store_true",
                    help="kill a decode worker even when it is the only healthy one (1P+1D on two GPUs)")
    ap.add_argument("--reference-device", default="cpu", help="where the reference engine runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--faults-wanted", type=int, default=None,
                    help="end the load once this many faults were made and every victim is back (or its watch "
                         "gave up); --duration-s then only bounds it (default: the load runs for --duration-s)")
    ap.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args(argv)
    faults = [k for k in args.faults.split(",") if k]
    bad = sorted(set(faults) - set(KINDS))
    if bad:
        ap.error(f"unknown fault kinds {bad}; choose from {', '.join(KINDS)}")
    if args.faults_wanted is not None and args.faults_wanted < 1:
        ap.error("--faults-wanted must be at least 1")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import ray

    from cluster.engine.engine import LLMEngine
    from cluster.model.demo import ensure_demo_model
    from deploy.config import ClusterConfig, ray_address_from_env
    from deploy.ray_runtime import workers_at_launcher_priority
    from deploy.serving_cluster import ServingCluster

    model = args.model or str(ensure_demo_model())
    # A running Ray named by RAY_ADDRESS (as `ray.init` and `pdserve serve` read it) is joined; else a local one starts.
    local = not ray_address_from_env()
    if local:
        workers_at_launcher_priority()
    ray.init(num_cpus=8 if local else None, include_dashboard=False, logging_level=logging.WARNING, log_to_driver=False)
    gpu = {} if args.device == "cpu" else {"gpus_per_worker": args.gpus_per_worker,
                                             "kv_memory_fraction": args.kv_memory_fraction}
    cfg = ClusterConfig(model=model, served_model_name=MODEL, port=0, device=args.device, dtype=args.dtype, **gpu,
                        prefill_workers=args.prefill_workers, decode_workers=args.decode_workers,
                        cpu_num_blocks=args.cpu_num_blocks, max_num_seqs=32, use_cuda_graph=args.device != "cpu",
                        stats_interval_s=0.05, cpus_per_worker=1.0, api_servers=1, ready_timeout_s=300,
                        prefill_placement="static", local_prefill_threshold=10, max_prefill_queue_s=1e9,
                        worker_max_restarts=-1)
    sc = ServingCluster(cfg, form_transport_group=chaos_transport_group(args.transfer_timeout_s))
    try:
        sc.start_in_thread(timeout_s=300)
        # The workers' greedy text must equal this engine's (same checkpoint and dtype).
        engine = LLMEngine(model, num_blocks=1024, max_num_seqs=64, dtype=args.dtype, device=args.reference_device)
        result = run(sc, engine, duration_s=args.duration_s, interval_s=args.interval_s, streams=args.streams,
                     max_tokens=args.max_tokens, deadline_s=args.deadline_s, seed=args.seed,
                     long_words=args.long_prompt_words, sole_decode_kills=args.sole_decode_kills, faults=faults,
                     faults_wanted=args.faults_wanted)
        result["config"]["transfer_timeout_s"] = args.transfer_timeout_s
    finally:
        sc.shutdown()
        ray.shutdown()
    result["command"] = "python -m benchmarks.chaos " + " ".join(sys.argv[1:] if argv is None else argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
