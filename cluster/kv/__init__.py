"""KV blocks: the block rules, content hashes, the block pool (prefix cache), the paged cache's layout, the limits a request must fit."""
