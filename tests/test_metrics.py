"""The metrics users graph: vLLM's series (names, types, buckets, ``model_name``) from the
processes that export them, and the shipped Grafana dashboard, whose every query names
a series some Baton service registers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.decode.decoder import DecodeMetrics
from services.gateway.metrics import ChoiceTimes, GatewayMetrics
from services.gateway.timeline import Timeline
from services.kvstore.metrics import StoreMetrics
from services.prefill.prefiller import PrefillMetrics
from shared.config import SloConfig
from shared.engine.request import CacheHit
from shared.engine.snapshot import EngineSnapshot
from shared.kvstore.connector_metrics import ConnectorMetrics
from shared.serving.worker_metrics import WorkerMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "baton-dashboard.json"
MODEL = "tiny-llama"

# vLLM V1's bucket layouts (vllm/v1/metrics/loggers.py, buckets.py)
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0]
TTFT += [7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5]
ITL += [10.0, 20.0, 40.0, 80.0]
REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0]
REQUEST += [60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
TOKENS_4096 = [1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0]

# The series vLLM's own example dashboard (examples/.../prometheus_grafana/grafana.json)
# queries, as "family: type"; all filter on model_name. Not exported:
# vllm:request_max_num_generation_tokens (the gateway does not record max_tokens).
VLLM_DASHBOARD = {
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_success": "counter",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
}

SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


def worker_registry(role: str = "prefill") -> tuple[WorkerMetrics, ConnectorMetrics]:
    base = WorkerMetrics(role)
    connector = ConnectorMetrics(base.registry)
    PrefillMetrics(base)
    DecodeMetrics(base)
    return base, connector


def service_registries() -> dict[str, CollectorRegistry]:
    """Every registry a Baton process serves on /metrics, built as the services build
    them (a worker's holds every role's families: they never clash)."""
    return {
        "gateway": GatewayMetrics(MODEL, 4096).registry,
        "worker": worker_registry()[0].registry,
        "kvstore": StoreMetrics().registry,
    }


def families(registry: CollectorRegistry) -> dict[str, str]:
    """Family name -> type, children or not (a labelled family with none has no samples)."""
    return {m.name: m.type for m in registry.collect()}


def series_names() -> set[str]:
    names: set[str] = set()
    for registry in service_registries().values():
        for name, kind in families(registry).items():
            names.update(name + s for s in SAMPLE_SUFFIXES[kind])
    return names


def scrape(registry: CollectorRegistry) -> dict[str, Any]:
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def buckets(family: Any) -> list[float]:
    bounds = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]
    assert bounds[-1] == float("inf")
    return bounds[:-1]


def value(family: Any, sample: str, **labels: str) -> float:
    for s in family.samples:
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise AssertionError(f"no {sample}{labels} in {family.name}")


# ---------------------------------------------------------------------------------------
def test_gateway_exports_vllms_request_series_with_the_model_name() -> None:
    m = GatewayMetrics(MODEL, 4096)
    m.prompt_tokens.inc(300)
    m.first_token(0.2, of_request=True)
    m.next_token(0.05)
    m.next_token(0.07)
    m.finished("ok", 0.0, [ChoiceTimes(first=0.2, last=0.32, tokens=3, finish_reason="length")])
    fams = scrape(m.registry)

    for name, kind in VLLM_DASHBOARD.items():
        if name in families(m.registry):
            assert fams[name].type == kind, name
            for s in fams[name].samples:
                assert s.labels["model_name"] == MODEL, s
    assert buckets(fams["vllm:time_to_first_token_seconds"]) == TTFT
    assert buckets(fams["vllm:inter_token_latency_seconds"]) == ITL
    assert buckets(fams["vllm:request_time_per_output_token_seconds"]) == ITL
    assert buckets(fams["vllm:e2e_request_latency_seconds"]) == REQUEST
    assert buckets(fams["vllm:request_decode_time_seconds"]) == REQUEST
    assert buckets(fams["vllm:request_prompt_tokens"]) == TOKENS_4096
    assert buckets(fams["vllm:request_generation_tokens"]) == TOKENS_4096

    assert value(fams["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == 300
    assert value(fams["vllm:generation_tokens"], "vllm:generation_tokens_total") == 3
    assert value(fams["baton_prompt_tokens"], "baton_prompt_tokens_total") == 300
    success = fams["vllm:request_success"]
    assert value(success, "vllm:request_success_total", finished_reason="length") == 1
    e2e = fams["vllm:e2e_request_latency_seconds"]
    assert abs(value(e2e, "vllm:e2e_request_latency_seconds_sum") - 0.32) < 1e-9
    tpot = fams["vllm:request_time_per_output_token_seconds"]
    assert abs(value(tpot, "vllm:request_time_per_output_token_seconds_sum") - 0.06) < 1e-9
    # Baton's own series record the same request under Baton's names
    assert value(fams["baton_ttft_seconds"], "baton_ttft_seconds_count") == 1
    assert value(fams["baton_itl_seconds"], "baton_itl_seconds_count") == 2
    assert value(fams["baton_requests"], "baton_requests_total", outcome="ok") == 1


def test_finish_reasons_follow_the_outcome_and_count_each_choice() -> None:
    m = GatewayMetrics(MODEL, 4096)
    m.finished("client_gone", 0.0, [])  # left before any token
    m.finished("error", 0.0, [ChoiceTimes(0.1, 0.2, 2)])  # broke mid-stream
    # two choices (n=2): one stopped, one hit max_tokens; each counts as vLLM counts it
    m.finished("ok", 0.0, [ChoiceTimes(0.1, 0.4, 4, "stop"), ChoiceTimes(0.1, 0.5, 1, "length")])
    fams = scrape(m.registry)
    success = fams["vllm:request_success"]
    for reason, count in {"abort": 1, "error": 1, "stop": 1, "length": 1}.items():
        assert value(success, "vllm:request_success_total", finished_reason=reason) == count
    gen = fams["vllm:request_generation_tokens"]
    assert value(gen, "vllm:request_generation_tokens_count") == 2
    # a one-token answer is a TPOT of 0 for vLLM, and left out of Baton's TPOT
    tpot = fams["vllm:request_time_per_output_token_seconds"]
    assert value(tpot, "vllm:request_time_per_output_token_seconds_count") == 2
    assert value(fams["baton_tpot_seconds"], "baton_tpot_seconds_count") == 1
    assert value(fams["baton_requests"], "baton_requests_total", outcome="ok") == 1
    assert value(fams["baton_e2e_seconds"], "baton_e2e_seconds_count") == 1


def test_requests_are_counted_within_and_outside_each_slo() -> None:
    """With targets set, every finished request is judged (a failed one misses, one whose
    client left is not judged) and the last minute's attainment follows."""
    m = GatewayMetrics(MODEL, 4096, SloConfig(ttft_s=1.0, tpot_s=0.1))
    m.finished("ok", 0.0, [ChoiceTimes(0.5, 1.4, 10, "stop")])  # TTFT 0.5, TPOT 0.1: met
    m.finished("ok", 0.0, [ChoiceTimes(2.0, 2.9, 10, "stop")])  # TTFT missed
    m.finished("ok", 0.0, [ChoiceTimes(0.5, 3.2, 10, "length")])  # TPOT 0.3 missed
    m.finished("error", 0.0, [])
    m.finished("client_gone", 0.0, [])
    slo = scrape(m.registry)["baton_slo_requests"]
    counts = {
        (target, outcome): value(slo, "baton_slo_requests_total", target=target, outcome=outcome)
        for target in ("ttft", "tpot", "both")
        for outcome in ("met", "missed")
    }
    assert counts == {
        ("ttft", "met"): 2, ("ttft", "missed"): 2,
        ("tpot", "met"): 2, ("tpot", "missed"): 2,
        ("both", "met"): 1, ("both", "missed"): 3,
    }  # fmt: skip
    a = m.slo_window.attainment()
    assert (a.requests, a.both_met) == (4, 0.25)


def test_without_targets_nothing_is_judged() -> None:
    m = GatewayMetrics(MODEL, 4096)
    m.finished("ok", 0.0, [ChoiceTimes(5.0, 9.0, 2, "stop")])
    assert not scrape(m.registry)["baton_slo_requests"].samples
    assert m.slo_window.attainment().describe() == "SLO not set"


def test_timeline_records_ttft_once_per_choice_and_the_finish_reason() -> None:
    m = GatewayMetrics(MODEL, 4096)
    timeline = Timeline(m, None)
    for index in (0, 1):
        timeline.token(index)
    timeline.token(0, "stop")
    timeline.token(1)
    timeline.token(1, "length")
    timeline.end("ok")
    fams = scrape(m.registry)
    ttft = fams["vllm:time_to_first_token_seconds"]
    assert value(ttft, "vllm:time_to_first_token_seconds_count") == 2  # per choice
    assert value(fams["baton_ttft_seconds"], "baton_ttft_seconds_count") == 1  # per request
    assert (
        value(fams["vllm:inter_token_latency_seconds"], "vllm:inter_token_latency_seconds_count")
        == 3
    )
    success = fams["vllm:request_success"]
    assert value(success, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(success, "vllm:request_success_total", finished_reason="length") == 1
    assert value(fams["vllm:generation_tokens"], "vllm:generation_tokens_total") == 5


def test_workers_export_vllms_engine_series_with_the_model_name() -> None:
    base, connector = worker_registry()
    base.bind(MODEL, "prefill-1")
    connector.bind(MODEL)
    snap = EngineSnapshot(waiting=2, running=3, loading=1, parked=1, free_slots=25, num_slots=100)
    base.observe_engine(snap, in_flight=7)
    base.observe_prompt_phases(0.4, 1.2)
    connector.observe_hit(1000, CacheHit(local_tokens=256, external_tokens=512))
    fams = scrape(base.registry)

    def one(name: str, sample: str | None = None) -> float:
        fam = fams[name]
        assert {s.labels.get("model_name") for s in fam.samples} == {MODEL}, name
        return value(fam, sample or name)

    assert fams["vllm:num_requests_running"].type == "gauge"
    assert one("vllm:num_requests_running") == 3
    assert one("vllm:num_requests_waiting") == 4  # queued, loading KV, parked
    assert one("vllm:kv_cache_usage_perc") == 0.75
    assert one("vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 1000
    assert one("vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 256
    assert (
        one("vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_queries_total") == 744
    )
    assert one("vllm:external_prefix_cache_hits", "vllm:external_prefix_cache_hits_total") == 512
    assert buckets(fams["vllm:request_queue_time_seconds"]) == REQUEST
    assert one("vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_sum") == 1.2
    info = fams["baton_instance_info"]
    assert value(info, "baton_instance_info", role="prefill", instance_id="prefill-1") == 1
    # Baton's own series, from the same calls
    assert value(fams["baton_kv_pool_usage"], "baton_kv_pool_usage") == 0.75
    assert value(fams["baton_requests_in_flight"], "baton_requests_in_flight") == 7
    hits = fams["baton_prefix_cache_hit_tokens"]
    assert value(hits, "baton_prefix_cache_hit_tokens_total", source="store") == 512


def test_every_series_vllms_dashboard_queries_is_exported() -> None:
    exported: dict[str, str] = {}
    for registry in service_registries().values():
        exported.update(families(registry))
    missing = {n: k for n, k in VLLM_DASHBOARD.items() if exported.get(n) != k}
    assert not missing


# ---------------------------------------------------------------------------------------
def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def test_dashboard_is_a_grafana_model_with_a_datasource_variable() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert board["title"] and board["uid"] and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert variables["model_name"]["type"] == "query"
    ids = [p["id"] for p in panels(board["panels"])]
    assert len(ids) == len(set(ids))
    graphs = [p for p in panels(board["panels"]) if p["type"] != "row"]
    assert len(graphs) >= 20
    for p in graphs:
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            expr = t["expr"]
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}")
            assert "[$__rate_interval]" in expr or "rate(" not in expr, expr


def test_every_series_the_dashboard_queries_is_registered() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", [])]
    used = {n for e in exprs for n in re.findall(r"(?<![\w:])(?:vllm:[\w:]+|baton_\w+)", e)}
    assert len(used) > 40
    assert not used - series_names()
    # the per-role panels join on the info series; the model variable finds vLLM's
    assert any("group_left(role) baton_instance_info" in e for e in exprs)
    assert all('model_name="$model_name"' in e for e in exprs if "vllm:" in e)
