"""The decode service: pulls prompt KV from the store and decodes with continuous batching."""
