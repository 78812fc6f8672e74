"""The "your machine" panel's API: what the page measured, checked, and with a profile replayed
through the simulator set up as the server publishes itself at /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from servelab.cost.profile import PROFILE_FORMAT, PROFILE_VERSION
from servelab.lab.app import create_lab_app

PROFILE = {
    "format": PROFILE_FORMAT,
    "version": PROFILE_VERSION,
    "model": "smollm2-135m",
    "fit": {
        "coefficients": {
            "per_step_s": 0.01,
            "per_token_s": 0.0,
            "per_seq_s": 0.0,
            "per_context_token_s": 0.0,
            "per_pair_s": 0.0,
        }
    },
}
# What `servelab serve` publishes about its scheduler and KV pool (servelab.server.metrics).
METRICS = (
    'servelab:cache_config_info{model_name="m",block_size="16",num_blocks="64"} 1.0\n'
    'servelab:scheduler_config_info{model_name="m",max_num_seqs="4",max_num_batched_tokens="256",'
    'max_model_len="512",policy="chunked",order="fcfs"} 1.0\n'
)


def _records(n: int = 4, output: int = 5) -> list[dict]:
    # Closed loop at concurrency 1: each request starts when the last ends; 10 ms per token.
    return [
        {
            "sent_s": i * 0.06,
            "first_token_s": i * 0.06 + 0.01,
            "last_token_s": i * 0.06 + 0.05,
            "prompt_tokens": 8,
            "output_tokens": output,
        }
        for i in range(n)
    ]


def test_with_a_profile_the_prediction_is_the_simulators_replay():
    client = TestClient(create_lab_app(lambda: METRICS, profile=PROFILE, profile_path="p.json"))
    setup = client.get("/api/live/setup").json()
    assert setup["engine"] and setup["profile"]["path"] == "p.json" and setup["defaults"]["requests"] >= 1
    d = client.post("/api/live/predict", json={"concurrency": 1, "records": _records()}).json()
    assert d["has_prediction"] and sum(d["ttft"]["measured"]) == sum(d["ttft"]["predicted"]) == 4
    # One request alone on a 10 ms-per-step engine: every step is 10 ms, so TPOT is 10 ms, as measured.
    assert d["predicted"]["tpot_s"]["p50"] == pytest.approx(0.010)
    assert d["measured"]["tpot_s"]["p50"] == pytest.approx(0.010)
    rows = {r["metric"]: r for r in d["comparison"]}
    assert rows["TPOT p50"]["error_pct"] == pytest.approx(0.0, abs=1e-6)
    assert "p.json" in d["notice"]


def test_without_a_profile_the_panel_measures_and_says_how_to_predict():
    client = TestClient(create_lab_app(lambda: METRICS))
    d = client.post("/api/live/predict", json={"concurrency": 2, "records": _records()}).json()
    assert not d["has_prediction"] and sum(d["tpot"]["predicted"]) == 0 and sum(d["tpot"]["measured"]) == 4
    assert "servelab calibrate" in d["why_no_prediction"] and "--profile" in d["notice"]


def test_a_failed_request_may_lack_its_token_times_and_counts_as_failed():
    client = TestClient(create_lab_app(lambda: METRICS, profile=PROFILE, profile_path="p.json"))
    records = _records()
    records[1] = {**records[1], "ok": False, "first_token_s": None, "last_token_s": None, "output_tokens": 0}
    d = client.post("/api/live/predict", json={"concurrency": 1, "records": records}).json()
    assert d["has_prediction"] and sum(d["ttft"]["measured"]) == 3
    assert {"label": "requests (ok / sent)", "value": "3 / 4"} in d["stats"]
    # a successful one must carry both, in order
    del records[2]["first_token_s"]
    r = client.post("/api/live/predict", json={"concurrency": 1, "records": records})
    assert r.status_code == 400 and "records[2].first_token_s: must be a finite number" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"concurrency": 1, "records": []}, "records: between 1 and 64 requests, got 0"),
        ({"concurrency": 1, "records": _records(65)}, "between 1 and 64 requests, got 65"),
        ({"concurrency": 17, "records": _records()}, "concurrency: must be an integer between 1 and 16"),
        (
            {
                "concurrency": 1,
                "records": [
                    {"sent_s": 0, "first_token_s": -1, "last_token_s": 1, "prompt_tokens": 1, "output_tokens": 2}
                ],
            },
            "records[0].first_token_s: must be a finite number",
        ),
        (
            {
                "concurrency": 1,
                "records": [
                    {"sent_s": 1, "first_token_s": 0.5, "last_token_s": 2, "prompt_tokens": 1, "output_tokens": 2}
                ],
            },
            "sent_s <= first_token_s <= last_token_s",
        ),
        ({"concurrency": 1, "think_ms": -5, "records": _records()}, "think_ms: must be a number between 0 and 10000"),
        ({"concurrency": 1, "think_ms": "20ms", "records": _records()}, "think_ms: must be a number"),
        ([1, 2], "must be a JSON object"),
        ({"concurrency": 1, "records": [{**_records(1)[0], "ok": "no"}]}, "records[0].ok: must be true or false"),
    ],
)
def test_bad_measurements_are_a_400_naming_the_field(body, needle):
    r = TestClient(create_lab_app(lambda: METRICS)).post("/api/live/predict", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_the_load_limits_are_published_with_the_lessons():
    from servelab.lab.limits import LIMITS

    limits = TestClient(create_lab_app()).get("/api/catalog").json()["limits"]["live"]
    assert {k: (v["min"], v["max"]) for k, v in limits.items()} == {k: tuple(v) for k, v in LIMITS["live"].items()}


def test_the_replay_pauses_as_long_as_the_pages_clients_did():
    # two clients, 10 ms a step: without a pause each follow-up joins the very next step; a client
    # that paused 25 ms sends its next request 25 ms after its last token, in the replay as here
    client = TestClient(create_lab_app(lambda: METRICS, profile=PROFILE, profile_path="p.json"))
    records = _records(6)
    none = client.post("/api/live/predict", json={"concurrency": 2, "records": records}).json()
    paused = client.post("/api/live/predict", json={"concurrency": 2, "think_ms": 25, "records": records}).json()
    assert none["config"]["think_ms"] == 0 and paused["config"]["think_ms"] == 25
    assert paused["predicted"]["duration_s"] > none["predicted"]["duration_s"] + 0.025
    assert "pausing 25 ms" in paused["notice"]


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b'{"concurrency": ' + b"9" * 5000 + b', "records": []}', "not valid JSON"),
        (b'{"concurrency": 1, "think_ms": NaN, "records": []}', "NaN is not a JSON number"),
    ],
)
def test_a_body_the_json_parser_chokes_on_is_a_400_not_a_500(raw, needle):
    # the server's own decoder (servelab.server.http_errors.decode_json_object), not a second one
    client = TestClient(create_lab_app(lambda: METRICS), raise_server_exceptions=False)
    r = client.post("/api/live/predict", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_the_standalone_lab_guards_content_type_and_body_size_as_serve_does():
    client = TestClient(create_lab_app(lambda: METRICS, max_request_bytes=1000))
    plain = client.post("/api/live/predict", content=b"{}", headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]["message"]
    big = client.post(
        "/api/live/predict", content=b"{" + b" " * 2000 + b"}", headers={"content-type": "application/json"}
    )
    assert big.status_code == 413 and "1,000 bytes" in big.json()["error"]["message"]
    ok = client.post("/api/live/predict", json={"concurrency": 1, "records": _records()})
    assert ok.status_code == 200, ok.text
