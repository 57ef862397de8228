"""Structured output: grammar-constrained decoding (JSON schema, json_object, regex, choice, EBNF,
tagged JSON for tool calls).

    structured_output.py   StructuredOutput: the constraint as it travels (kind + spec), TaggedJSON
    grammar.py             the backend interface: GrammarBackend (check, compile, matcher), GrammarMatcher
    registry.py            backends by name, imported lazily (xgrammar_backend.py: the default)
    grammar_compiler.py    GrammarCompiler: admission check, compile pool, cache by key
    request_grammar.py     RequestGrammar: one request's matcher (ready / accept), fill_bitmasks

Where the mask is applied: the decode step (decode_worker/bucketed_graph_runner.py, the kernel in
cluster/kernels/token_bitmask.py) and the host-side first-token sampler (cluster.sampler.sample_tokens).
Importing this package does not import a backend.
"""

from cluster.structured.grammar_compiler import GrammarCompiler
from cluster.structured.request_grammar import RequestGrammar, fill_bitmasks
from cluster.structured.structured_output import JSONTag, StructuredOutput, TaggedJSON

__all__ = ["GrammarCompiler", "JSONTag", "RequestGrammar", "StructuredOutput", "TaggedJSON", "fill_bitmasks"]
