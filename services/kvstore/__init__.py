"""KV object store service (issue: KV object store and the UCX data plane)."""
