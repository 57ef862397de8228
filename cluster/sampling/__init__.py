"""Sampling: per-request parameters, their device tables, the batched sampler, logprobs, a model's generation defaults."""
