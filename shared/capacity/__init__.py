"""Capacity: what the engine costs here (profile), which deployment serves best (plan)."""
