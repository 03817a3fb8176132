"""``baton profile``'s arguments: it measures what ``baton up`` deploys."""

from __future__ import annotations

from shared.cli import build_parser


def test_profile_meters_the_transport_that_baton_up_runs() -> None:
    parser = build_parser()
    up = parser.parse_args(["up"])
    profile = parser.parse_args(["profile"])
    assert profile.transport == up.transport  # the store's CPU and speed depend on it
    assert parser.parse_args(["profile", "--transport", "tcp"]).transport == "tcp"
