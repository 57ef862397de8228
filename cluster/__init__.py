"""pdserve: disaggregated prefill/decode serving. `cluster` is the engine core every worker shares:
config, model, KV layout, sampling, transport, the request limits. It imports nothing above it (the
launcher is the application layer, deploy/)."""
