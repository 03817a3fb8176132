"""Library shared by every Baton service: model, KV layout, engine, config."""
