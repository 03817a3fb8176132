"""Client side of the KV object store: wire protocol, placement, and the client library."""
