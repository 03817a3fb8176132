"""KV cache: the block layout, content-hash block keys and the paged tensor pool (its
positions are slots; the engine's KV cache manager decides who holds which)."""
