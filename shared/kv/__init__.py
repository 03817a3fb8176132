"""KV cache: block layout, content-hash block ids, the block pool and the paged tensor pool."""
