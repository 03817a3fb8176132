"""The peer benchmark's table: Baton's ratios to each peer, per scenario."""

from __future__ import annotations

import pytest

from benchmarks.peers import Figures, combine, parse_args, ratios, round_ratios, servers, table


def test_ratios_are_batons_figure_over_the_peers() -> None:
    ours = Figures(ttft_p50=0.4, tpot_p50=0.02, output_tok_s=90.0, failed=0)
    peer = Figures(ttft_p50=0.8, tpot_p50=0.04, output_tok_s=60.0, failed=0)
    assert ratios(ours, peer) == pytest.approx({"ttft": 0.5, "tpot": 0.5, "throughput": 1.5})


def test_table_lists_every_server_and_says_what_did_not_run() -> None:
    ours = Figures(0.4, 0.02, 90.0, 0)
    results: dict[str, dict[str, Figures | str]] = {
        "Baton": {"512 in": ours},
        "vLLM": {"512 in": Figures(0.8, 0.04, 60.0, 2)},
        "llama.cpp": {"512 in": "llama.cpp exited with 1"},
    }
    text = table(results, "Baton")
    assert "| 512 in | Baton | 400 ms | 20.0 ms | 90.0 | | | |" in text
    assert "| 512 in | vLLM | 800 ms | 40.0 ms | 60.0 | 0.50× | 0.50× | 1.50× | (2 failed)" in text
    assert "| 512 in | llama.cpp | llama.cpp exited with 1 |" in text


def test_peers_left_out_are_skipped() -> None:
    names = [s.name for s in servers(parse_args([]))]
    assert names == ["Baton (baton up, defaults)"]
    args = parse_args(
        ["--llama-server", "/x/llama-server", "--gguf", "BF16=/m.gguf", "--llama-threads", "1", "2"]
    )
    assert [s.name for s in servers(args)][1:] == [
        "llama.cpp BF16, 1 thread(s)",
        "llama.cpp BF16, 2 thread(s)",
    ]


def test_baton_variants_run_after_the_defaults_with_their_arguments() -> None:
    got = servers(parse_args(["--baton-variant", "fixed threads=--max-threads 1"]))
    assert [s.name for s in got] == [
        "Baton (baton up, defaults)",
        "Baton (baton up, fixed threads)",
    ]
    assert got[1].command[-2:] == ["--max-threads", "1"]
    assert "--max-threads" not in got[0].command


def test_rounds_combine_to_medians_and_ratios_within_each_round() -> None:
    """Interleaved rounds: each figure's median over the rounds, failures summed, and
    Baton's ratio to the peer in each round (a round either side failed is left out)."""
    ours = [Figures(0.2, 0.02, 60.0, 0), Figures(0.3, 0.03, 40.0, 1), Figures(0.1, 0.01, 80.0, 0)]
    theirs: list[Figures | str] = [
        Figures(0.25, 0.02, 50.0, 0),
        Figures(0.3, 0.02, 50.0, 0),
        "vLLM exited with 1",
    ]
    rounds: list[dict[str, dict[str, Figures | str]]] = [
        {"Baton": {"512 in": o}, "vLLM": {"512 in": t}} for o, t in zip(ours, theirs, strict=True)
    ]
    combined = combine(rounds)
    assert combined["Baton"]["512 in"] == Figures(0.2, 0.02, 60.0, 1)
    assert combined["vLLM"]["512 in"] == "vLLM exited with 1"
    by_round = round_ratios(rounds, "Baton")
    assert [r["ttft"] for r in by_round["vLLM"]["512 in"]] == pytest.approx([0.8, 1.0])
    assert "Baton" not in by_round


def test_rounds_must_be_positive() -> None:
    assert parse_args(["--rounds", "3"]).rounds == 3
    with pytest.raises(SystemExit):
        parse_args(["--rounds", "0"])
