"""Cluster state in Redis: membership with heartbeats and the global block index."""
