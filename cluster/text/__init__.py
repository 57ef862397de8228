"""Text: tokenizer loading and prompt encoding, incremental detokenization with stop strings, a request's text deltas."""
