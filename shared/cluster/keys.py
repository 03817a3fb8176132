"""Every Redis key Baton uses, in one place, under one prefix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "baton"

    def member(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}:member:{role}:{instance_id}"

    def member_pattern(self, role: str) -> str:
        return f"{self.prefix}:member:{role}:*"

    def block(self, block_id: str) -> str:
        return f"{self.prefix}:block:{block_id}"
