"""What the serving services (gateway, prefill, decode) share: wire types, the worker base, logs."""
