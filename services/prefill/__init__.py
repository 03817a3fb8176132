"""Prefill service: the prompt phase (issue: disaggregated serving end to end)."""
