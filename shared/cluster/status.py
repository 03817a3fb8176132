"""The live cluster as Redis knows it: every registered instance, its role, address,
load, KV usage, cache hit rate and last heartbeat (what ``baton status`` prints)."""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.membership import Member, live_members

STATUS_ROLES = ("prefill", "decode", "colocated", "kvstore")
COLUMNS = ("instance", "role", "address", "dtype", "load", "kv use", "cache hits", "heartbeat")


async def cluster_members(redis: aioredis.Redis, keys: Keys) -> list[Member]:
    """Every live instance of every role, by role then instance id."""
    return [m for role in STATUS_ROLES for m in await live_members(redis, keys, role)]


def _role(member: Member) -> str:
    """The registered role; a mixed instance adds what it serves at the moment."""
    load = member.load
    if not load.get("mixed"):
        return member.role
    serving = [r for r in ("prefill", "decode") if load.get(f"serving_{r}", 0.0) > 0.0]
    return f"{member.role} (mixed: {'+'.join(serving) or 'idle'})"


def _load(member: Member) -> str:
    load = member.load
    if load.get("mixed"):
        text = (
            f"{load.get('jobs', 0):.0f} jobs, {load.get('pending_tokens', 0):.0f} tok queued, "
            f"{load.get('running', 0):.0f} running, {load.get('waiting_kv', 0):.0f} waiting"
        )
    elif member.role == "prefill":
        text = f"{load.get('jobs', 0):.0f} jobs, {load.get('pending_tokens', 0):.0f} tok queued"
    elif member.role in ("decode", "colocated"):
        text = f"{load.get('running', 0):.0f} running, {load.get('waiting_kv', 0):.0f} waiting"
    elif member.role == "kvstore":
        used, capacity = load.get("bytes_used", 0.0), member.capacity_bytes or 0
        mib = f"{used / 2**20:.0f}/{capacity / 2**20:.0f} MiB"
        text = f"{load.get('blocks_held', 0):.0f} blocks, {mib}"
    else:
        text = "-"
    return text + (", draining" if load.get("draining") else "")


def row(member: Member, now: float) -> tuple[str, ...]:
    """One instance as the table shows it (``now``: wall clock, for the heartbeat age)."""
    load = member.load
    usage = load.get("kv_usage")
    if member.role == "kvstore" and member.capacity_bytes:
        usage = load.get("bytes_used", 0.0) / member.capacity_bytes
    hits = load.get("cache_hit_rate")
    age = f"{max(0.0, now - member.heartbeat_at):.1f}s ago" if member.heartbeat_at else "-"
    return (
        member.instance_id,
        _role(member),
        f"{member.host}:{member.http_port}"
        + (f" (data {member.data_port})" if member.data_port else ""),
        member.dtype or "-",
        _load(member),
        "-" if usage is None else f"{usage:.0%}",
        "-" if hits is None else f"{hits:.0%}",
        age,
    )


def render(members: Sequence[Member], now: float) -> str:
    """A fixed-width table, one instance a line."""
    if not members:
        return "no live instance registered"
    rows = [COLUMNS, *(row(m, now) for m in members)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )
