"""DecodeScheduler with constrained sequences, on CPU with a fake grammar: a constrained row never runs
with a token in flight (it skips the step launched while its token is on the device), waits for its
grammar, goes last in the batch; the free rows keep pipelining; prompt scoring ends at the arrival."""

from cluster.sampling.logprobs import PrefillLogprobs, TokenLogprobs
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence
from decode_worker.block_manager import BlockManager
from decode_worker.scheduler import DecodeScheduler


class FakeGrammar:
    """Ready when told; accepts every token but `refuse`; terminated after `length` tokens."""

    def __init__(self, length=100, refuse=-1):
        self.is_ready, self.accepted, self.length, self.refuse, self.error = False, [], length, refuse, None

    def ready(self):
        return self.is_ready

    def accept(self, token):
        if token == self.refuse:
            self.error = f"token {token} refused"
            return False
        self.accepted.append(token)
        return True

    def is_terminated(self):
        return len(self.accepted) >= self.length


def make_scheduler():
    return DecodeScheduler(BlockManager(64, 4), 8, max_prefill_tokens=64, max_model_len=1024)


def seq(rid, grammar=None, max_tokens=8, **kw):
    s = Sequence(rid, list(range(10, 15)), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw),
                 seed=0, eos_token_ids=(1,))
    s.grammar = grammar
    return s


def arrive(s, sq, first=100, logprobs=None):
    assert s.reserve(sq)
    return s.on_arrival(sq.request_id, first, ok=True, logprobs=logprobs)


def rows(batch):
    return [(r.seq.request_id, r.prev_row) for r in batch.rows]


def test_a_constrained_row_skips_the_step_launched_while_its_token_is_in_flight():
    s = make_scheduler()
    g = FakeGrammar()
    c, a, b = seq("c", g), seq("a"), seq("b")
    arrive(s, c, first=100)
    assert g.accepted == [100]  # the prefill's first token, kept while the grammar compiles
    arrive(s, a), arrive(s, b)
    b0 = s.schedule_decode(0, pipeline_busy=False)
    assert rows(b0) == [("a", -1), ("b", -1)]  # c's grammar is not ready: not scheduled, the others go
    s.on_step_launched(b0)
    g.is_ready = True
    b1 = s.schedule_decode(1, pipeline_busy=True)
    assert rows(b1) == [("a", 0), ("b", 1), ("c", -1)]  # constrained rows last
    s.on_step_launched(b1)
    s.on_step_output(b0, [7, 8])
    b2 = s.schedule_decode(2, pipeline_busy=True)
    assert rows(b2) == [("a", 0), ("b", 1)]  # c's token is in flight in step 1: it skips step 2
    s.on_step_launched(b2)
    s.on_step_output(b1, [9, 10, 101])
    assert g.accepted == [100, 101]
    b3 = s.schedule_decode(3, pipeline_busy=True)
    r = {x.seq.request_id: x for x in b3.rows}
    assert rows(b3) == [("a", 0), ("b", 1), ("c", -1)]
    assert r["c"].token_id == 101 and r["c"].position == 6  # its input comes from the host
    assert r["a"].position == 8 and c.num_tokens == 7  # a has a token in flight: one position further


def test_a_grammar_ends_its_sequence_when_complete_or_when_it_refuses_a_token():
    s = make_scheduler()
    done, bad = FakeGrammar(length=3), FakeGrammar(refuse=55)
    done.is_ready = bad.is_ready = True
    c, d = seq("c", done), seq("d", bad)
    arrive(s, c, first=100), arrive(s, d, first=100)
    b0 = s.schedule_decode(0, pipeline_busy=False)
    s.on_step_launched(b0)
    assert s.schedule_decode(1, pipeline_busy=True).rows == []  # both in flight
    out = s.on_step_output(b0, [5, 55])
    assert [(x.request_id, x.finish_reason, x.error) for x in out] == [("c", None, None),
                                                                        ("d", "error", "token 55 refused")]
    b2 = s.schedule_decode(2, pipeline_busy=False)
    s.on_step_launched(b2)
    (x,) = s.on_step_output(b2, [6])
    assert (x.request_id, x.finish_reason) == ("c", "stop")  # its grammar accepted its last token
    assert not s.running
    s.check_blocks()


def test_local_prefill_waits_for_the_grammar_and_scoring_ends_at_the_arrival():
    s = make_scheduler()
    g = FakeGrammar()
    c, f = seq("c", g), seq("f")
    assert s.add_local(c) and s.add_local(f)
    assert [q.request_id for q, _ in s.schedule_prefill()] == ["f"]  # c's grammar compiles: f goes ahead
    g.is_ready = True
    assert [q.request_id for q, _ in s.schedule_prefill()] == ["c", "f"]
    score = seq("s", max_tokens=0, prompt_logprobs=1)
    prompt = (None,) + (TokenLogprobs(-1.0),) * 4
    d = arrive(s, score, first=100, logprobs=PrefillLogprobs(None, prompt))
    assert (d.token_ids, d.finish_reason, d.prompt_logprobs) == ((), "length", prompt)
    assert score.output_token_ids == [] and score not in s.running
