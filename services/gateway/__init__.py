"""OpenAI-compatible HTTP gateway (issue: disaggregated serving end to end)."""
