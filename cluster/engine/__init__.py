"""Running the model: the in-process LLMEngine, the eager and graph runners, their bucket and chunking rules, warm-up, sequences."""
