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
        """The set of instances holding block ``block_id`` (a block key in hex)."""
        return f"{self.prefix}:block:{block_id}"

    def holds(self, instance_id: str) -> str:
        """The set of block ids one instance holds (to clear them all at once)."""
        return f"{self.prefix}:holds:{instance_id}"
