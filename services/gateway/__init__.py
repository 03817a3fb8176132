"""The gateway: OpenAI-compatible API, SSE streaming, routing to prefill and decode."""
