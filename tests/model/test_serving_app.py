"""The server on the tiny model, for each engine, over loopback with the real clients: `openai` (completions and
chat, streamed or not) and huggingface_hub's InferenceClient (TGI's text_generation, streamed or not)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from serving.in_process import serving_in_thread
from serving.models import ServedModel
from tasks.config import ServeConfig, TargetConfig
from tasks.engines import Runtime, load_runtime
from tests.factories import TINY_ENGINE_RECIPES

RECIPES = TINY_ENGINE_RECIPES  # the engines tiny_engine_dir builds
PROMPT = "Near the river 12, the stone walks the garden."


@pytest.fixture(scope="module", params=sorted(RECIPES))
def runtime(request, tiny_engine_dir) -> Runtime:
    return load_runtime(tiny_engine_dir(request.param), TargetConfig(threads=1))


def live_server(
    runtime: Runtime, settings: ServeConfig, version: str = "3"
) -> contextlib.AbstractContextManager[tuple[str, ServedModel]]:
    """(URL, served model) of the app under uvicorn on a free loopback port, in a thread; stopped on exit."""
    return serving_in_thread(runtime, "tiny", settings, version)


@pytest.fixture(scope="module")
def url(runtime) -> Iterator[str]:
    with live_server(runtime, ServeConfig(max_new_tokens=8)) as (base, _):
        yield base


def test_openai_completions_streamed_or_not_give_the_greedy_continuation(url, runtime):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    whole = client.completions.create(model="tiny/3", prompt=PROMPT, max_tokens=6, temperature=0)
    expected = runtime.generate([runtime.encode(PROMPT)], 6)[0]
    assert whole.choices[0].text == runtime.decode(expected)
    assert whole.usage.completion_tokens == len(expected) and whole.usage.prompt_tokens == len(
        runtime.encode(PROMPT)
    )
    assert whole.choices[0].finish_reason == ("stop" if expected[-1] == runtime.eos_token_id else "length")
    chunks = list(
        client.completions.create(model="tiny/3", prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
    )
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_openai_chat_uses_the_chat_template_streamed_or_not(url, runtime):
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is the river?"},
    ]
    whole = client.chat.completions.create(model="tiny/3", messages=messages, max_tokens=5, temperature=0)
    template = runtime.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = runtime.encode(template)
    assert whole.choices[0].message.content == runtime.decode(runtime.generate([prompt], 5)[0])
    assert whole.usage.prompt_tokens == len(prompt)
    stream = client.chat.completions.create(
        model="tiny/3",
        messages=messages,
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == whole.choices[0].message.content
    )
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_tgi_text_generation_through_huggingface_hub_streamed_or_not(url, runtime, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    # offline mode (set for the whole suite) blocks every URL, loopback included; this client talks to loopback only
    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    client = InferenceClient(model=url)
    expected = runtime.decode(runtime.generate([runtime.encode(PROMPT)], 6)[0])
    assert client.text_generation(PROMPT, max_new_tokens=6) == expected
    details = client.text_generation(PROMPT, max_new_tokens=6, details=True)
    assert details.generated_text == expected and details.details.generated_tokens == len(
        details.details.tokens
    )
    events = list(client.text_generation(PROMPT, max_new_tokens=6, stream=True, details=True))
    assert "".join(event.token.text for event in events) == expected
    assert events[-1].generated_text == expected and events[-1].details.finish_reason in (
        "length",
        "eos_token",
    )


def test_sampling_is_reproducible_by_seed_and_top_k_1_is_greedy(url):
    import httpx

    def text(**sampling) -> str:
        body = {"prompt": PROMPT, "max_tokens": 8, **sampling}
        return httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]

    greedy = text(temperature=0)
    assert text(temperature=1.5, top_k=1, seed=1) == greedy  # one candidate left: sampling must pick it
    draws = {text(temperature=2.0, seed=seed) for seed in range(6)}
    assert text(temperature=2.0, seed=3) == text(temperature=2.0, seed=3)
    assert len(draws) > 1  # an untrained model at temperature 2 spreads its mass: seeds differ


def test_a_stop_string_ends_the_answer_before_it(url):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    full = httpx.post(f"{url}/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]
    stop = full[2:4]
    cut = httpx.post(f"{url}/v1/completions", json={**body, "stop": [stop]}, timeout=30).json()["choices"][0]
    assert cut["text"] == full[: full.index(stop)] and cut["finish_reason"] == "stop"


def test_an_evaluation_harness_loglikelihood_request_scores_as_the_pipeline_does(url, runtime):
    """lm-evaluation-harness's request for a loglikelihood task (`echo`, `logprobs: 1`, `max_tokens: 0`): the
    prompt's token log-probabilities sum to what the pipeline's evaluation (`Runtime.score`) computes through the
    same engine, within 1e-4 (float32 logits summed in another order), and the top token says whether it is greedy."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    scored = client.completions.create(model="tiny/3", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    ids = runtime.encode(PROMPT)
    nll, count = runtime.score([ids])[0]
    assert choice.text == PROMPT and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == len(ids) and choice.logprobs.token_logprobs[0] is None
    # the same engine's float32 logits, normalised and summed in another order: ~1e-6 apart; 1e-4 is generous
    assert sum(choice.logprobs.token_logprobs[1:]) == pytest.approx(-nll, abs=1e-4) and count == len(ids) - 1
    for logprob, top in zip(
        choice.logprobs.token_logprobs[1:], choice.logprobs.top_logprobs[1:], strict=True
    ):
        assert len(top) == 1 and max(top.values()) >= logprob - 1e-6
    with_answer = client.completions.create(
        model="tiny/3", prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0
    )
    assert len(with_answer.choices[0].logprobs.token_logprobs) == len(ids) + 3
    assert with_answer.choices[0].text.startswith(PROMPT)


def test_llmopt_serve_shows_its_own_info_lines_once_in_uvicorns_format(capsys):
    """What a loaded version runs on (the engines' verdicts at INFO) reaches the console of `llmopt serve`, once."""
    import logging

    from serving.app import show_own_logs

    loggers = [logging.getLogger(name) for name in ("tasks", "llmopt")]
    kept = [(logger.level, logger.propagate, list(logger.handlers)) for logger in loggers]
    root = logging.StreamHandler()  # a handler of the root's, as a library may install: no second copy
    logging.getLogger().addHandler(root)
    try:
        show_own_logs()
        logging.getLogger("tasks.engines.onnx.float_prompts").info("planted: the graph runs them")
        logging.getLogger("llmopt.serve").warning("planted: moved")
        logging.getLogger("tasks.engines").debug("planted: not shown")
    finally:
        logging.getLogger().removeHandler(root)
        for logger, (level, propagate, handlers) in zip(loggers, kept, strict=True):
            logger.setLevel(level)
            logger.propagate = propagate
            logger.handlers[:] = handlers
    lines = [line for line in capsys.readouterr().err.splitlines() if "planted" in line]
    assert lines == ["INFO:     planted: the graph runs them", "WARNING:  planted: moved"], lines
