"""pdserve: disaggregated prefill/decode serving. `cluster` holds what every worker shares: config,
model, KV layout, sampling, transport and the launcher."""
