"""loadtest/tp_cpu.py, the issue-26 CPU results table: every case's tests exist (collected, not run), and a
case is ok only when each of its tests passed (a failed, skipped or missing test makes it not ok)."""

from loadtest import tp_cpu


def test_every_case_names_tests_that_exist():
    assert tp_cpu.main(["--check"]) == 0


def test_a_case_is_ok_only_when_all_its_tests_passed():
    ids = [i for v in tp_cpu.CASES.values() for i in v]
    passed = {i: ("passed", 1.0, "") for i in ids}
    assert all(r["ok"] for r in tp_cpu.rows(passed))
    kill = tp_cpu.CASES["rank_killed_mid_stream_migrates_exact_no_hang_group_restarts"][-1]
    for outcome in ("failed", "skipped"):
        table = tp_cpu.rows({**passed, kill: (outcome, 2.0, "AssertionError: x")})
        bad = [r for r in table if not r["ok"]]
        assert [r["case"] for r in bad] == ["rank_killed_mid_stream_migrates_exact_no_hang_group_restarts"]
        assert f"{kill} {outcome} in 2.0s (AssertionError: x)" in bad[0]["detail"]
    missing = dict(passed)
    del missing[tp_cpu.CASES["kv_transfer_exact_p1_d2"][0]]
    assert [r["case"] for r in tp_cpu.rows(missing) if not r["ok"]] == ["kv_transfer_exact_p1_d2"]
    assert {tuple(r) for r in tp_cpu.rows(passed)} == {("case", "ok", "detail")}
