"""Every Redis key Baton uses, in one place, under one prefix."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    prefix: str = "baton"

    def member(self, role: str, instance_id: str) -> str:
        return f"{self.prefix}:member:{role}:{instance_id}"

    def members(self, role: str) -> str:
        """The set of instance ids that registered as ``role`` (each also has its TTL'd
        member key; a listed id whose key expired is dead and is pruned by readers)."""
        return f"{self.prefix}:members:{role}"

    def block(self, block_id: str) -> str:
        """The set of instances holding block ``block_id`` (a block key in hex)."""
        return f"{self.prefix}:block:{block_id}"

    def holds(self, instance_id: str) -> str:
        """The set of block ids one instance holds (to clear them all at once)."""
        return f"{self.prefix}:holds:{instance_id}"

    def watermark(self, request_id: str) -> str:
        """A running request's replication watermark (see shared.cluster.watermarks)."""
        return f"{self.prefix}:wm:{request_id}"

    def in_flight(self, block_id: str) -> str:
        """The prefill instances computing a prompt with block ``block_id`` (a sorted set
        scored by when each entry lapses; see shared.cluster.in_flight)."""
        return f"{self.prefix}:inflight:{block_id}"

    def holders(self) -> str:
        """The set of instance ids that have entries in the prompt index."""
        return f"{self.prefix}:holders"

    def slo(self) -> str:
        """The gateway's latest SLO attainment (see shared.cluster.slo)."""
        return f"{self.prefix}:slo"

    def response(self, response_id: str) -> str:
        """A resumable response's record (a hash; see shared.cluster.event_log)."""
        return f"{self.prefix}:resp:{response_id}"

    def response_events(self, response_id: str) -> str:
        """Its events, in order (a stream; entry id ``<sequence number + 1>-0``)."""
        return f"{self.prefix}:resp:{response_id}:events"

    def response_tokens(self, response_id: str) -> str:
        """The token ids its logged events carry (a list; a new owner replays them)."""
        return f"{self.prefix}:resp:{response_id}:tokens"

    def response_lease(self, response_id: str) -> str:
        """Who may append to it: ``<owner>:<epoch>``, with a TTL its owner renews."""
        return f"{self.prefix}:resp:{response_id}:lease"
