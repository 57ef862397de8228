"""The shared-prefix workloads and their theoretical reuse, on CPU."""

from benchmarks.prefix_workload import few_shot, multi_turn, theoretical_reuse


def test_multi_turn_resends_the_conversation_and_orders_turns():
    reqs = multi_turn(sessions=3, turns=4, system_tokens=100, seed=1)
    assert len(reqs) == 12 and [r.turn for r in reqs[:3]] == [0, 0, 0]
    by = {}
    for r in reqs:
        by.setdefault(r.session, []).append(r)
    for turns in by.values():
        assert [t.turn for t in turns] == [0, 1, 2, 3]
        for a, b in zip(turns, turns[1:]):
            assert b.prompt[: len(a.prompt)] == a.prompt and len(b.prompt) > len(a.prompt) + 80
    assert len({r.prompt[:100] for r in reqs}) == 1  # one system prompt
    assert multi_turn(sessions=3, turns=4, system_tokens=100, seed=1) == reqs


def test_theoretical_reuse_counts_whole_blocks_of_what_was_sent_before():
    bs = 16
    # Two prompts: the second extends the first (33 tokens: two full blocks).
    a = list(range(10, 43))
    assert theoretical_reuse([a, a + [7] * 10], bs) == (32, 33 + 43)
    # The same prompt twice: the last token's block is never a hit.
    assert theoretical_reuse([a[:32], a[:32]], bs) == (16, 64)
    reqs = multi_turn(sessions=4, turns=3, system_tokens=160, seed=2)
    hits, total = theoretical_reuse([r.prompt for r in reqs], bs)
    # Turn 0: sessions 2-4 reuse the system prompt's 10 blocks; later turns reuse the whole previous
    # prompt's full blocks at least.
    floor = 3 * 160 + sum(len(r.prompt) // bs * bs for r in reqs if r.turn < 2)
    assert floor <= hits < total


def test_few_shot_reuses_the_template():
    reqs = few_shot(requests=10, template_tokens=320, seed=3)
    hits, total = theoretical_reuse([r.prompt for r in reqs], 16)
    assert hits == 9 * 320 and total == sum(len(r.prompt) for r in reqs)


def test_report_checks_the_targets():
    from benchmarks.prefix_cache_report import checks, table

    def row(cache, hit, ttft, moved, thr=4.0, workload="multi_turn"):
        return {"setup": "disaggregated", "workload": workload, "request_rate": 4.0, "cache": cache,
                "requests": 192, "completed": 192, "failed": 0, "hit_rate": hit, "theoretical_reuse": 0.8,
                "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "tpot_p50_ms": 10.0, "goodput_rps": thr,
                "throughput_rps": thr, "prefill_tokens_per_s": 1e4, "kv_transfer_bytes": moved}

    good = checks([row("on", 0.78, 50.0, 2.2e9), row("off", 0.0, 200.0, 10e9)])
    assert [ok for _, ok, _ in good] == [True, True, True]
    bad = checks([row("on", 0.6, 100.0, 5e9), row("off", 0.0, 200.0, 10e9, thr=2.0)])
    assert [ok for _, ok, _ in bad] == [False, False, False]
    assert "saturated" in bad[1][2]
    assert "multi_turn" in table([row("on", 0.78, 50.0, 2.2e9)])
