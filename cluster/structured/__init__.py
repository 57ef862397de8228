"""Structured output: grammar-constrained decoding (JSON schema, json_object, regex, choice, EBNF,
tagged JSON for tool calls).

    structured_output.py   StructuredOutput: the constraint as it travels (kind + spec), TaggedJSON
    grammar.py             the backend interface: GrammarBackend (check, compile, matcher), GrammarMatcher
    registry.py            backends by name, imported lazily (xgrammar_backend.py: the default)
    grammar_compiler.py    GrammarCompiler: admission check, compile pool, cache by key
    compile_process.py     CompileProcess: one compile at a time in a child, killed at its deadline
    request_grammar.py     RequestGrammar: one request's matcher (ready / accept), fill_bitmasks

Where the mask is applied: the decode step (decode_worker/bucketed_graph_runner.py, the kernel in
cluster/kernels/token_bitmask.py) and the host-side first-token sampler (cluster.sampling.sampler.sample_tokens).
Importing this package imports neither a backend nor torch: SamplingParams carries a
StructuredOutput, and `pdserve serve --help` reads SamplingParams' module; the names that need torch
(GrammarCompiler, RequestGrammar, fill_bitmasks) load on first use.
"""

from cluster.structured.structured_output import JSONTag, StructuredOutput, TaggedJSON

_LAZY = {"GrammarCompiler": "cluster.structured.grammar_compiler", "RequestGrammar": "cluster.structured.request_grammar",
         "fill_bitmasks": "cluster.structured.request_grammar"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["GrammarCompiler", "JSONTag", "RequestGrammar", "StructuredOutput", "TaggedJSON", "fill_bitmasks"]
