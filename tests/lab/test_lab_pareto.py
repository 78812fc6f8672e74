"""The capacity-pareto lesson's API: its inputs' errors name the input, a deployment that does not
fit says why, and a stopping server ends it with a 503."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from servelab.lab.app import create_lab_app
from servelab.lab.pareto_lesson import MAX_ACCELERATORS


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_lab_app())


def post(client: TestClient, body: dict):
    return client.post("/api/lessons/capacity-pareto", json=body)


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"accelerators": "h100-sxm,tpu-v9"}, "accelerators", "unknown 'tpu-v9'"),
        ({"accelerators": "h200,h200"}, "accelerators", "with repeats"),
        ({"accelerators": "h100-sxm,h200,a100-80gb,l4,b200"}, "accelerators", f"between 1 and {MAX_ACCELERATORS}"),
        ({"accelerators": " , "}, "accelerators", "got 0"),
        ({"tpot_ms": "0"}, "tpot_ms", "between 1 and"),
        ({"output_len": "1"}, "output_len", "between 2 and"),
        ({"prompt_len": "32768", "output_len": "4096", "model": "llama-2-7b"}, "context", "maximum context"),
    ],
)
def test_bad_inputs_are_400s_naming_the_input(client, body, param, needle):
    response = post(client, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and needle in error["message"]


def test_catalog_publishes_the_lessons_limits_and_defaults(client):
    catalog = client.get("/api/catalog").json()
    assert "capacity-pareto" in catalog["lessons"]
    assert catalog["limits"]["capacity-pareto"]["output_len"] == {"min": 2, "max": 4096}
    assert catalog["defaults"]["capacity-pareto"]["accelerators"] == "h100-sxm,a100-80gb"
    assert catalog["context_rules"]["capacity-pareto"]["fields"] == ["prompt_len", "output_len"]


def test_a_deployment_that_does_not_fit_is_named_with_what_to_change(client):
    d = post(client, {"accelerators": "h100-sxm,b200", "model": "llama-3.1-70b", "output_len": "16"}).json()
    assert d["verdicts"]["h100-sxm"] == "does not fit" and "raise tp" in d["warning"]
    h100 = next(c for c in d["curves"] if c["hardware"] == "h100-sxm")
    assert h100["capacity"] is None and h100["points"]["concurrency"] == []
    b200 = next(c for c in d["curves"] if c["hardware"] == "b200")  # 192 GB holds the 141 GB of weights
    assert b200["capacity"] is not None and "b200 serves the most" in d["notice"]
    assert d["commands"][0].startswith("servelab plan --model llama-3.1-70b --hardware h100-sxm,b200 ")


def test_the_chart_is_drawn_from_points_that_show_the_tradeoff(client):
    d = post(client, {"accelerators": "a100-80gb", "tpot_ms": "40", "prompt_len": "512", "output_len": "32"}).json()
    (curve,) = d["curves"]
    points = curve["points"]
    front = [j for j, on in enumerate(points["pareto"]) if on]
    per_user = [points["tokens_per_s_per_user"][j] for j in front]
    per_gpu = [points["tokens_per_s_per_device"][j] for j in front]
    assert per_user == sorted(per_user) and per_gpu == sorted(per_gpu, reverse=True)  # faster users, fewer tokens/s
    assert min(per_user) < d["tpot_line_tokens_per_s_per_user"] < max(per_user)  # the line crosses the curve
    assert curve["price_per_device_hour"] > 0 and all(v > 0 for v in points["usd_per_million_tokens"])


def test_a_stopping_server_refuses_the_lesson(client):
    app = create_lab_app()
    app.state.stop()
    response = TestClient(app).post("/api/lessons/capacity-pareto", json={"accelerators": "h100-sxm"})
    assert response.status_code == 503
