"""SequenceBuilder: a request as the decode worker's Sequence, refused (400) before anything is reserved.

Both ways into the decode worker (DecodeWorker.reserve for a prompt prefilled elsewhere, submit_local
for one prefilled here) build their Sequence here, on the caller's thread, so that a request the loop
could not serve never reaches it: the one fit rule (cluster.kv.request_limits: context length and this
worker's KV pool), token ids the sampling kernels can index, and a grammar that compiles.
"""

from __future__ import annotations

from cluster.errors import InvalidRequestError
from cluster.wire.messages import GenerateRequest
from cluster.model.config import ModelArchConfig
from cluster.kv.request_limits import check_request_fits
from cluster.engine.sequence import Sequence
from cluster.structured.grammar_compiler import GrammarCompiler
from decode_worker.block_manager import BlockManager


class SequenceBuilder:
    def __init__(self, worker_id: str, arch: ModelArchConfig, max_model_len: int, block_size: int,
                 blocks: BlockManager, grammars: GrammarCompiler):
        self.worker_id = worker_id
        self.arch = arch
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.blocks = blocks
        self.grammars = grammars

    def build(self, req: GenerateRequest) -> Sequence:
        """The request's Sequence (its grammar attached); InvalidRequestError if it cannot be served here."""
        n = len(req.prompt_token_ids)
        if n == 0:
            raise InvalidRequestError("empty prompt", "prompt")
        p = req.params
        check_request_fits(n, p.max_tokens, self.max_model_len, block_size=self.block_size,
                           kv_blocks=self.blocks.capacity, holder=f"decode worker {self.worker_id}")
        if not all(-(2**63) <= x < 2**63 for x in (p.top_k, *p.stop_token_ids)):
            # Checked here, not in the loop: an int64 overflow there would fail every request.
            raise InvalidRequestError("top_k and stop_token_ids must fit in 64 bits", "top_k")
        p.check_token_ids(self.arch.vocab_size)  # they index the sampling kernels' tables
        seq = Sequence(request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), params=req.params,
                       seed=req.seed, eos_token_ids=self.arch.eos_token_ids, detokenizer=None,
                       resumed_tokens=req.resumed_tokens)
        if p.structured is not None:  # a bad schema is a 400 here, before anything is reserved
            self.grammars.check(p.structured)
            # A migrated request's prompt ends with the tokens it generated: its grammar replays them.
            prior = req.prompt_token_ids[n - req.resumed_tokens:] if req.resumed_tokens else ()
            seq.grammar = self.grammars.grammar_for(p.structured, req.request_id, prior)
        return seq
