"""`baton bench`: drive an OpenAI-compatible endpoint, measured as vLLM's benchmark does."""
