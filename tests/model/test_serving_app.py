"""The HTTP app around a real (tiny) runtime: OpenAI-shaped answers, malformed requests refused."""

import pytest
from fastapi.testclient import TestClient

from serving.app import create_app


@pytest.fixture(scope="module")
def client(baseline_runtime):
    return TestClient(create_app(baseline_runtime, "tiny", "3", max_new_tokens=8))


def test_completion_follows_the_openai_shape_and_caps_tokens(client):
    response = client.post("/v1/completions", json={"prompt": "The river walks", "max_tokens": 50})
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == "tiny/3"
    assert body["usage"]["completion_tokens"] <= 8
    assert (
        body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    )
    assert isinstance(body["choices"][0]["text"], str)


def test_greedy_completion_is_deterministic(client):
    request = {"prompt": "The book opens", "max_tokens": 6}
    assert (
        client.post("/v1/completions", json=request).json()["choices"]
        == client.post("/v1/completions", json=request).json()["choices"]
    )


@pytest.mark.parametrize(
    "payload",
    [{}, {"prompt": ""}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "bogus": 1}, {"prompt": 3}],
)
def test_malformed_requests_get_422_naming_the_field(client, payload):
    response = client.post("/v1/completions", json=payload)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"][0] == "body"


def test_health_and_models_name_the_served_version(client):
    assert client.get("/health").json()["model"] == "tiny/3"
    assert client.get("/v1/models").json()["data"][0]["id"] == "tiny/3"
