"""When the gateway lends a mixed instance to the other role (Splitwise's mixed pool).

A mixed instance (``services.mixed``) registers as its home role and can serve the
other one too. The gateway sends it the other role's work only while

- the other role is over its bound: every instance of that role's own has more
  queued prompt tokens than ``prefill_tokens`` (prefill), or runs at least
  ``decode_running`` streams or has requests waiting for KV space (decode); and
- the mixed instance's own queue is empty: no prompt tokens queued (a prefill
  instance; the prompt of the request being placed, if it is computing there, does
  not count), no request waiting for KV and fewer than ``decode_running`` streams
  (a decode instance); and a decode instance's own streams have room: its recent
  steps (``step_s`` in its load, prompt chunks it took included) average under
  ``decode_step_s``, so lending stops while the prompts it took push its streams'
  time per output token up, and resumes once they are back under it;

or while that role has no instance of its own left (then every mixed one serves it).

With latency targets (``baton up --slo-ttft/--slo-tpot``, :meth:`LendPolicy.for_slo`)
the bounds come from them: prefill is over its bound when the prompts queued at an
instance would take longer than :data:`TTFT_RISK_SHARE` of the TTFT target at the rate
it computes prompts lately (``tokens_s`` in its load; the token bound until it has
one), so a prompt is lent when its first token is at risk, not after a fixed count;
and a decode instance is lent only while its steps stay under the share of the TPOT
target that decode paces to (:data:`shared.engine.step_pacer.PACE_MARGIN`), so its
streams keep their target.

It gives the instance back as soon as either stops being true: the next request of
the other role goes elsewhere, and work already there finishes there. Pure logic on
the published loads plus this gateway's own picks (``score``), so it is tested
without a cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from shared.cluster.membership import Member
from shared.config import SloConfig
from shared.engine.step_pacer import PACE_MARGIN

Score = Callable[[Member, str], float]  # (member, role) -> its queue in that role's units

# with a TTFT target, a prompt is at risk once the queue ahead of it at every prefill
# instance would take this share of the target: lending costs its streams a bounded
# TPOT (the step bound), while a queue that grows in a burst costs every later prompt
TTFT_RISK_SHARE = 0.1


def other_role(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class LendPolicy:
    prefill_tokens: float = 512.0
    decode_running: float = 32.0
    decode_step_s: float = 0.075  # 0: a decode instance's step time does not count
    ttft_s: float | None = None  # a TTFT target: prefill's bound is a wait, not tokens

    def for_slo(self, slo: SloConfig, *, step_bound_given: bool = False) -> LendPolicy:
        """These bounds under the cluster's latency targets: a TTFT target makes
        prefill's bound the estimated wait; a TPOT target sets the decode step bound
        (unless ``step_bound_given``: set explicitly)."""
        step_s = self.decode_step_s
        if slo.tpot_s is not None and not step_bound_given:
            step_s = PACE_MARGIN * slo.tpot_s
        return replace(self, decode_step_s=step_s, ttft_s=slo.ttft_s)

    def prefill_wait_s(self, member: Member, score: Score) -> float | None:
        """How long the prompts queued at a prefill instance would take at its recent
        rate (None: it has not computed any yet)."""
        rate = member.load.get("tokens_s", 0.0)
        return score(member, "prefill") / rate if rate > 0 else None

    def over_bound(self, role: str, own: Sequence[Member], score: Score) -> bool:
        """Whether ``role``'s own instances are all past its bound (or there are none)."""
        return all(self._busy(role, m, score) for m in own)

    def idle_for_own_role(self, member: Member, score: Score) -> bool:
        """Whether a mixed instance's own queue is empty, so it may be lent."""
        if not member.load.get("mixed"):
            return False
        if member.role == "prefill":
            return score(member, "prefill") <= 0.0
        return (
            member.load.get("waiting_kv", 0.0) <= 0.0
            and score(member, "decode") < self.decode_running
            # one lent prompt at a time: every stream there waits for each prompt it takes
            and score(member, "prefill") <= 0.0
            and not (self.decode_step_s and member.load.get("step_s", 0.0) >= self.decode_step_s)
        )

    def lendable(
        self, role: str, own: Sequence[Member], others: Sequence[Member], score: Score
    ) -> list[Member]:
        """The other role's mixed instances that may take ``role``'s next request: all of
        them when ``role`` has no instance of its own left."""
        mixed = [m for m in others if m.load.get("mixed")]
        if not own:
            return mixed
        if not mixed or not self.over_bound(role, own, score):
            return []
        return [m for m in mixed if self.idle_for_own_role(m, score)]

    def _busy(self, role: str, member: Member, score: Score) -> bool:
        if role == "prefill":
            wait = self.prefill_wait_s(member, score) if self.ttft_s is not None else None
            if self.ttft_s is not None and wait is not None:
                return wait > TTFT_RISK_SHARE * self.ttft_s
            return score(member, "prefill") > self.prefill_tokens
        return (
            member.load.get("waiting_kv", 0.0) > 0.0
            or score(member, "decode") >= self.decode_running
        )


def serving(members: Sequence[Member], role: str) -> int:
    """How many of ``members`` (the other role's) serve ``role`` at the moment."""
    return sum(1 for m in members if m.load.get(f"serving_{role}", 0.0) > 0.0)
