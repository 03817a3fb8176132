"""Decode service: the token phase (issue: disaggregated serving end to end)."""
