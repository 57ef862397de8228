"""Where a request goes: the placement policies, the KV block index, prefill local vs remote and its cost model, the P:D planner."""
