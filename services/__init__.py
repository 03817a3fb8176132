"""Baton services: gateway, prefill, decode and the KV store, one package each."""
