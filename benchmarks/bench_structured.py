"""Structured-output benchmark on one GPU: what grammar masks cost the decode step, and grammar compile
time.

1. The decode step at batch 64 (Llama-3.1-8B shape, random bf16 weights, 512-token prompts) with 0, 8
   and 64 constrained rows, against the unconstrained step (a runner built without the mask kernel,
   as before structured output). Every row has the same batch every step here (no skipping): the
   CUDA-event time of the step (`gpu_step_ms`), and on the host the step's preparation, of which the
   masks' fill (xgrammar, a 50-field schema's state per row). Targets: unconstrained rows <= 1.05x (the
   0-row step, the mask kernel in the graph, against the old step), fully constrained <= 1.25x.
2. The decode loop as the worker runs it (DecodeScheduler + BucketedGraphRunner, step t+1 launched
   before step t's tokens are read; a constrained row skips the step launched while its token is in
   flight): wall time per step, and tokens/s per free and per constrained row.
3. Grammar compile time for a 50-field schema: the admission check (parse) and the compile, and the
   backend's start-up (tokenizer tables).

Vocabulary: no real 128k tokenizer is reachable from the GPU host, so the grammar runs over a
synthetic byte-level vocabulary of the model's size (every byte, JSON punctuation, the demo corpus'
words with and without a leading space and capitalised, then letter n-grams up to 6 characters,
seeded): the mask fill and compile costs scale with the vocabulary's size and shape, which this
keeps; the model's logits are random anyway.

    python -m benchmarks.bench_structured [--out loadtest/results/structured_h200.json]
    python -m benchmarks.bench_structured --dry-run --out /tmp/structured.json   # CPU, tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import time
import traceback
from pathlib import Path

import torch

from cluster.kv.kv_cache import KVCacheSpec
from cluster.model.config import ModelArchConfig
from cluster.model.loader import random_model
from cluster.sampling.sampling_params import SamplingParams
from cluster.engine.sequence import Sequence, SequenceStatus
from cluster.structured import GrammarCompiler, StructuredOutput
from decode_worker.block_manager import BlockManager
from decode_worker.bucketed_graph_runner import BucketedGraphRunner
from decode_worker.scheduler import DecodeRow, DecodeScheduler
from benchmarks.common import hf_config_dict

PROMPT_LEN = 512
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
TARGETS = {"unconstrained_rows": 1.05, "fully_constrained": 1.25}


def log(*a):
    print(*a, flush=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


# -- the vocabulary ---------------------------------------------------------------------------------
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def synthetic_tokenizer(vocab_size: int, first_special: int):
    """A byte-level BPE tokenizer of `vocab_size` tokens (see the module docstring): ordinary tokens
    below `first_special`, special ones from there up (Llama 3's layout: begin-of-text, end-of-text,
    then reserved ones)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    enc = _bytes_to_unicode()
    to_token = lambda s: "".join(enc[b] for b in s.encode())  # noqa: E731
    words = set((Path(__file__).parents[1] / "cluster" / "model" / "demo_corpus.txt").read_text().split())
    extra = ['{"', '"}', '":', '": ', '", "', '", ', ', "', "[", "]", "{}", "[]", "true", "false", "null", "\n", "  "]
    extra += [str(i) for i in range(1000)]
    for w in sorted(words):
        w = w.strip(string.punctuation)
        extra += [w, " " + w, w.capitalize(), " " + w.capitalize()]
    vocab = {enc[b]: b for b in range(256)}
    for piece in extra:
        if len(vocab) >= first_special:
            break
        vocab.setdefault(to_token(piece), len(vocab))
    rng = random.Random(0)
    while len(vocab) < first_special:
        n = rng.randint(2, 6)
        piece = ("" if rng.random() < 0.5 else " ") + "".join(rng.choice(string.ascii_lowercase) for _ in range(n))
        vocab.setdefault(to_token(piece), len(vocab))
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [f"<|reserved_{i}|>" for i in range(vocab_size - first_special - 2)]
    for i, t in enumerate(specials):
        vocab[t] = first_special + i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                   additional_special_tokens=specials[2:])


# -- the schema -------------------------------------------------------------------------------------
def schema_with_fields(n: int) -> dict:
    """n required fields of mixed kinds (bounded strings, integer ranges, enums, booleans, numbers,
    arrays, a nested object every tenth)."""
    props = {}
    for i in range(n):
        k = i % 6
        if i % 10 == 9:
            p = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                                  "label": {"type": "string", "maxLength": 16}},
                 "required": ["id", "label"]}
        elif k == 0:
            p = {"type": "string", "maxLength": 24}
        elif k == 1:
            p = {"type": "integer", "minimum": -1000, "maximum": 1000}
        elif k == 2:
            p = {"enum": ["red", "green", "blue", "unknown"]}
        elif k == 3:
            p = {"type": "boolean"}
        elif k == 4:
            p = {"type": "number"}
        else:
            p = {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4}
        props[f"field_{i:02d}"] = p
    return {"type": "object", "properties": props, "required": list(props)}


# -- the bench --------------------------------------------------------------------------------------
class Bench:
    def __init__(self, shape: str, batch: int, device: str):
        d = hf_config_dict(shape)
        d["max_position_embeddings"] = 4096
        if d["vocab_size"] <= d["eos_token_id"]:  # the tiny shape: its specials inside its vocabulary
            d["bos_token_id"], d["eos_token_id"] = d["vocab_size"] - 2, d["vocab_size"] - 1
        assert d["eos_token_id"] == d["bos_token_id"] + 1
        self.arch = ModelArchConfig.from_dict(d)
        self.device, self.batch = device, batch
        torch.manual_seed(0)
        backend = "triton" if device == "cuda" else "torch"
        self.model = random_model(self.arch, torch.bfloat16, device, attention_backend=backend)
        blocks = batch * (MAX_MODEL_LEN // BLOCK_SIZE) + 2
        self.spec = KVCacheSpec.for_model(self.arch, BLOCK_SIZE, blocks, torch.bfloat16)
        self.kv_cache = torch.empty(self.spec.shape, dtype=torch.bfloat16, device=device).normal_()
        self.model.bind_kv_cache(self.kv_cache)
        kw = dict(block_size=BLOCK_SIZE, max_num_seqs=batch, max_blocks_per_seq=MAX_MODEL_LEN // BLOCK_SIZE,
                  buckets=(batch,))
        self.plain = BucketedGraphRunner(self.model, self.kv_cache, grammar_masks=False, **kw)  # the old step
        self.masked = BucketedGraphRunner(self.model, self.kv_cache, **kw)
        t0 = time.perf_counter()
        self.tokenizer = synthetic_tokenizer(self.arch.vocab_size, d["bos_token_id"])
        self.tokenizer_build_s = time.perf_counter() - t0
        self.grammars = GrammarCompiler(lambda: self.tokenizer, self.arch.vocab_size, self.arch.eos_token_ids)

    def sequences(self, constrained: int, so: StructuredOutput, temperature: float = 1.0) -> list[Sequence]:
        seqs = []
        for i in range(self.batch):
            params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=temperature, seed=i,
                                    structured=so if i < constrained else None)
            s = Sequence(f"r{i}", [(7 * k + i) % 1000 for k in range(PROMPT_LEN)], params, seed=i,
                         eos_token_ids=self.arch.eos_token_ids)
            if i < constrained:
                s.grammar = self.grammars.grammar_for(so, s.request_id)
                assert s.grammar.wait(300), s.grammar.error
            seqs.append(s)
        return seqs

    def step_times(self, runner: BucketedGraphRunner, constrained: int, so: StructuredOutput, steps: int) -> dict:
        """The same batch every step (all rows present, host input tokens): per-step device time and
        host preparation; the constrained rows' grammars advance with their sampled tokens."""
        seqs = self.sequences(constrained, so)
        tables = [list(range(1 + i * (MAX_MODEL_LEN // BLOCK_SIZE), 1 + i * (MAX_MODEL_LEN // BLOCK_SIZE)
                             + PROMPT_LEN // BLOCK_SIZE + 2)) for i in range(self.batch)]
        for s, t in zip(seqs, tables):
            s.block_table, s.status = t, SequenceStatus.RUNNING
        last = [7] * self.batch
        gpu, prepare, accept = [], [], []
        for _ in range(steps):
            rows = [DecodeRow(s, last[i], -1, PROMPT_LEN) for i, s in enumerate(seqs)]
            h = runner.launch(rows)
            toks = h.tokens()
            gpu.append(h.gpu_time_s)
            prepare.append(h.info.host_prepare_s)
            t0 = time.perf_counter()
            for i, s in enumerate(seqs[:constrained]):
                if not s.grammar.accept(toks[i]) or s.grammar.is_terminated():  # start over: keep masks live
                    s.grammar = self.grammars.grammar_for(so, s.request_id)
                    s.grammar.wait(60)
            accept.append(time.perf_counter() - t0)
            last = toks
        skip = min(5, steps // 4)
        return {"gpu_step_ms": median(gpu[skip:]) * 1e3, "host_prepare_us": median(prepare[skip:]) * 1e6,
                "grammar_accept_us": median(accept[skip:]) * 1e6}

    def loop(self, runner: BucketedGraphRunner, constrained: int, so: StructuredOutput, steps: int) -> dict:
        """The worker's loop body (see bench_decode.Bench.run_loop): wall time per step and tokens/s."""
        sched = DecodeScheduler(BlockManager(self.spec.num_blocks, BLOCK_SIZE), self.batch, 4096, MAX_MODEL_LEN)
        seqs = self.sequences(constrained, so)
        brace = self.tokenizer.convert_tokens_to_ids("{")  # the first token: one every row's grammar allows
        for s in seqs:
            assert sched.reserve(s)
            sched.on_arrival(s.request_id, brace, ok=True)
        inflight, walls, step = None, [], 0
        t_start = last = time.perf_counter()
        while step < steps or inflight is not None:
            launched = None
            if step < steps:
                batch = sched.schedule_decode(step, pipeline_busy=inflight is not None)
                if batch.rows:
                    launched = (batch, runner.launch(batch.rows))
                    sched.on_step_launched(batch)
                step += 1
            if inflight is not None:
                b, h = inflight
                sched.on_step_output(b, h.tokens(), h.logprobs())
                now = time.perf_counter()
                walls.append(now - last)
                last = now
            inflight = launched
        elapsed = time.perf_counter() - t_start
        free = [len(s.output_token_ids) - 1 for s in seqs[constrained:]]
        cons = [len(s.output_token_ids) - 1 for s in seqs[:constrained]]
        skip = min(5, len(walls) // 4)
        return {"wall_step_ms": median(walls[skip:]) * 1e3, "steps": steps,
                "free_row_tokens_per_s": (sum(free) / len(free) / elapsed) if free else None,
                "constrained_row_tokens_per_s": (sum(cons) / len(cons) / elapsed) if cons else None}


def compile_times(bench: Bench, fields: int) -> dict:
    so = StructuredOutput.json_schema(schema_with_fields(fields))
    t0 = time.perf_counter()
    backend = bench.grammars.prepare().result()
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bench.grammars.check(so)
    check_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):  # the backend itself, uncached
        t0 = time.perf_counter()
        backend.compile(so)
        runs.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    assert bench.grammars.grammar_for(so, "first").wait(300)
    first_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert bench.grammars.grammar_for(so, "cached").wait(60)
    cached_s = time.perf_counter() - t0
    return {"fields": fields, "spec_chars": len(so.spec), "vocab_size": bench.arch.vocab_size,
            "backend_init_s": init_s, "check_s": check_s, "compile_s": median(runs), "compile_runs_s": runs,
            "grammar_for_first_s": first_s, "grammar_for_cached_s": cached_s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true", help="CPU, a tiny model, batch 4: checks the script")
    ap.add_argument("--out", default="loadtest/results/structured_h200.json")
    ap.add_argument("--shape", default=None, help="model shape (bench_decode's SHAPES), default llama-8b-shape")
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    assert args.dry_run or torch.cuda.is_available(), "the structured-output benchmark needs a GPU (or --dry-run)"
    shape = args.shape or ("tiny-shape" if args.dry_run else "llama-8b-shape")
    batch = 4 if args.dry_run else 64
    counts = (0, 1, batch) if args.dry_run else (0, 8, 64)
    steps = args.steps or (6 if args.dry_run else 40)
    fields = 50
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "torch": torch.__version__, "command": " ".join(sys.argv), "model": shape, "batch_size": batch,
              "prompt_len": PROMPT_LEN, "targets": TARGETS, "step": [], "loop": [], "compile": None, "errors": []}

    def save():
        out.write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    bench = Bench(shape, batch, device)
    result["vocabulary"] = {"kind": "synthetic byte-level (see the module docstring)",
                            "size": bench.arch.vocab_size, "build_s": bench.tokenizer_build_s}
    bench.plain.capture(progress=False)
    bench.masked.capture(progress=False)
    log(f"{shape}: model, vocabulary and 4 graphs in {time.perf_counter() - t0:.1f}s")
    try:
        result["compile"] = compile_times(bench, fields)
        c = result["compile"]
        log(f"compile, {fields}-field schema over {c['vocab_size']} tokens: check {c['check_s'] * 1e3:.1f} ms, "
            f"compile {c['compile_s'] * 1e3:.1f} ms (backend start-up {c['backend_init_s']:.2f} s)")
    except Exception as e:  # noqa: BLE001 - keep the other measurements
        traceback.print_exc()
        result["errors"].append(f"compile: {e!r}")
    save()
    so = StructuredOutput.json_schema(schema_with_fields(fields))
    base = None
    for label, runner, k in [("unconstrained step (no mask kernel)", bench.plain, 0)] + [
            (f"{k} constrained rows", bench.masked, k) for k in counts]:
        try:
            row = {"case": label, "mask_kernel": runner.grammar_masks, "constrained_rows": k,
                   **bench.step_times(runner, k, so, steps)}
            base = base or row["gpu_step_ms"]
            row["vs_unconstrained"] = row["gpu_step_ms"] / base
            result["step"].append(row)
            log(f"  step, {label:36s}: gpu {row['gpu_step_ms']:.3f} ms (x{row['vs_unconstrained']:.3f}), "
                f"prepare {row['host_prepare_us']:.0f} us, accept {row['grammar_accept_us']:.0f} us")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["errors"].append(f"step {label}: {e!r}")
        save()
    for label, runner, k in [("unconstrained (no mask kernel)", bench.plain, 0)] + [
            (f"{k} constrained rows", bench.masked, k) for k in counts]:
        try:
            row = {"case": label, "mask_kernel": runner.grammar_masks, "constrained_rows": k,
                   **bench.loop(runner, k, so, steps)}
            result["loop"].append(row)
            log(f"  loop, {label:36s}: wall {row['wall_step_ms']:.3f} ms/step, free rows "
                f"{row['free_row_tokens_per_s'] or 0:.0f} tok/s, constrained rows "
                f"{row['constrained_row_tokens_per_s'] or 0:.0f} tok/s")
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            result["errors"].append(f"loop {label}: {e!r}")
        save()
    steps_by_k = {r["constrained_rows"]: r for r in result["step"] if r["mask_kernel"]}
    if 0 in steps_by_k and batch in steps_by_k:
        result["met"] = {"unconstrained_rows": steps_by_k[0]["vs_unconstrained"] <= TARGETS["unconstrained_rows"],
                         "fully_constrained": steps_by_k[batch]["vs_unconstrained"] <= TARGETS["fully_constrained"]}
    bench.grammars.close()
    save()
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
