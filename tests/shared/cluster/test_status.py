"""``baton status``'s table from membership records (no Redis)."""

from __future__ import annotations

from shared.cluster.membership import Member
from shared.cluster.status import COLUMNS, render, row


def member(role: str, **fields: object) -> Member:
    base: dict[str, object] = {
        "instance_id": f"{role}-1",
        "role": role,
        "host": "10.0.0.5",
        "http_port": 8100,
        "heartbeat_at": 100.0,
    }
    return Member.model_validate(base | fields)


def test_rows_show_load_usage_hits_and_heartbeat_age() -> None:
    prefill = member(
        "prefill",
        dtype="bfloat16",
        load={"jobs": 2, "pending_tokens": 900, "kv_usage": 0.25, "cache_hit_rate": 0.5},
    )
    assert row(prefill, now=101.5) == (
        "prefill-1", "prefill", "10.0.0.5:8100", "bfloat16",
        "2 jobs, 900 tok queued", "25%", "50%", "1.5s ago",
    )  # fmt: skip
    decode = member("decode", load={"running": 3, "waiting_kv": 1, "draining": 1.0})
    assert row(decode, now=100.0)[4] == "3 running, 1 waiting, draining"
    assert row(decode, now=100.0)[6] == "-"  # no prompt looked up yet
    store = member(
        "kvstore",
        data_port=8301,
        capacity_bytes=1 << 30,
        load={"blocks_held": 10, "bytes_used": 256 << 20},
    )
    cells = row(store, now=100.0)
    assert cells[2] == "10.0.0.5:8100 (data 8301)"
    assert cells[4] == "10 blocks, 256/1024 MiB" and cells[5] == "25%"


def test_a_mixed_instance_shows_what_it_serves_now() -> None:
    lent = member(
        "decode",
        load={"mixed": 1.0, "serving_prefill": 1.0, "serving_decode": 4.0, "jobs": 1,
              "pending_tokens": 300, "running": 4},
    )  # fmt: skip
    cells = row(lent, now=100.0)
    assert cells[1] == "decode (mixed: prefill+decode)"
    assert cells[4] == "1 jobs, 300 tok queued, 4 running, 0 waiting"
    idle = member("prefill", load={"mixed": 1.0})
    assert row(idle, now=100.0)[1] == "prefill (mixed: idle)"


def test_table_is_aligned_and_says_when_empty() -> None:
    table = render([member("prefill"), member("decode")], now=100.0).splitlines()
    assert len(table) == 3 and table[0].split()[0] == COLUMNS[0]
    assert table[1].index("prefill", 10) == table[0].index("role")
    assert render([], now=0.0) == "no live instance registered"
