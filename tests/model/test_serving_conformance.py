"""Wire conformance with the real clients: TGI's own `text_generation` client and huggingface_hub's
InferenceClient on TGI's routes, `openai` on OpenAI's, each with the parameters those clients and load generators
send. The parameters act in the scheduler, which every engine shares, so the torch engine answers here."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tasks.config import ServeConfig, TargetConfig
from tasks.engines import Runtime, load_runtime
from tasks.params import VariantConfig
from tasks.techniques.build import build_variant
from tests.model.test_serving_app import PROMPT, live_server


@pytest.fixture(scope="module")
def runtime(tiny_base, tmp_path_factory) -> Runtime:
    folder = tmp_path_factory.mktemp("conformance") / "torch"
    build_variant("torch", VariantConfig.model_validate({}), tiny_base, "d", folder)
    return load_runtime(folder, TargetConfig(threads=1))


@pytest.fixture(scope="module")
def url(runtime) -> Iterator[str]:
    with live_server(runtime, ServeConfig(max_new_tokens=12)) as (base, _):
        yield base


def greedy(runtime: Runtime, prompt: list[int], tokens: int) -> str:
    return runtime.decode(runtime.generate([prompt], tokens, stop_at_eos=False)[0])


# --- TGI ----------------------------------------------------------------------------------------------------------


def test_tgi_info_says_where_the_model_runs_and_its_limits(url, runtime):
    """/info as TGI writes it: `model_device_type` is the device ("cpu" here), not the engine's name."""
    info = httpx.get(f"{url}/info", timeout=30).json()
    assert info["model_device_type"] == "cpu"
    assert info["max_total_tokens"] == runtime.context_length == info["max_input_tokens"] + 1
    assert info["model_pipeline_tag"] == "text-generation"


def test_tgi_client_takes_every_parameter_and_reports_top_tokens(url, runtime):
    from text_generation import Client

    client = Client(url, timeout=60)
    answer = client.generate(
        PROMPT,
        max_new_tokens=6,
        repetition_penalty=1.2,
        frequency_penalty=0.3,
        truncate=8,
        top_n_tokens=3,
        best_of=1,
        decoder_input_details=False,
        seed=4,
    )
    tokens = answer.details.tokens
    assert answer.details.generated_tokens == len(tokens) == len(answer.details.top_tokens) > 0
    for token, top in zip(tokens, answer.details.top_tokens, strict=True):
        logprobs = [candidate.logprob for candidate in top]
        assert len(top) == 3 and logprobs == sorted(logprobs, reverse=True)
        assert token.logprob <= logprobs[0] + 1e-6
    assert client.generate(PROMPT, max_new_tokens=4, typical_p=0.5, seed=1).generated_text


def test_tgi_truncate_keeps_the_last_input_tokens(url, runtime):
    from text_generation import Client

    ids = runtime.encode(PROMPT)
    answer = Client(url, timeout=60).generate(PROMPT, max_new_tokens=5, truncate=6)
    assert answer.generated_text == runtime.decode(runtime.generate([ids[-6:]], 5)[0])


def test_tgi_samples_when_a_temperature_is_set_as_tgi_does(url, runtime):
    from text_generation import Client

    client = Client(url, timeout=60)  # the client sends do_sample: false unless told otherwise
    expected = greedy(runtime, runtime.encode(PROMPT), 8)
    assert client.generate(PROMPT, max_new_tokens=8).generated_text == expected
    assert client.generate(PROMPT, max_new_tokens=8, temperature=1.0).generated_text == expected  # no warper
    drawn = {
        client.generate(PROMPT, max_new_tokens=8, temperature=1.9, seed=s).generated_text for s in range(5)
    }
    assert drawn != {expected}


def test_tgi_keeps_the_stop_sequence_streamed_or_not(url, runtime):
    from text_generation import Client

    client = Client(url, timeout=60)
    full = client.generate(PROMPT, max_new_tokens=8).generated_text
    stop = full[3:5]
    cut = full[: full.index(stop) + len(stop)]
    answer = client.generate(PROMPT, max_new_tokens=8, stop_sequences=[stop])
    assert answer.generated_text == cut and answer.details.finish_reason == "stop_sequence"
    events = list(client.generate_stream(PROMPT, max_new_tokens=8, stop_sequences=[stop]))
    assert "".join(event.token.text for event in events) == cut == events[-1].generated_text


def test_tgi_refusals_take_tgi_error_shape_and_the_client_raises_its_own_error(url):
    from text_generation import Client
    from text_generation.errors import ValidationError

    client = Client(url, timeout=60)
    with pytest.raises(ValidationError, match="watermark"):
        client.generate(PROMPT, max_new_tokens=4, watermark=True)
    with pytest.raises(ValidationError, match="best_of"):
        client.generate(PROMPT, max_new_tokens=4, best_of=2, do_sample=True)
    for body in (
        {"inputs": PROMPT, "parameters": {"colour": "red"}},
        {"inputs": PROMPT, "parameters": {"top_n_tokens": 99}},
        {"inputs": ""},
    ):
        response = httpx.post(f"{url}/generate", json=body, timeout=30)
        assert response.status_code == 422, body
        assert (
            set(response.json()) == {"error", "error_type"} and response.json()["error_type"] == "validation"
        )
    colour = httpx.post(f"{url}/generate", json={"inputs": PROMPT, "parameters": {"colour": 1}}, timeout=30)
    assert "parameters.colour" in colour.json()["error"]


def test_tgi_info_and_tokenize(url, runtime, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)  # loopback only
    info = InferenceClient(model=url, provider="hf-inference").get_endpoint_info()
    assert info["max_total_tokens"] == runtime.context_length and info["max_best_of"] == 1
    assert info["model_pipeline_tag"] == "text-generation"
    tokens = httpx.post(f"{url}/tokenize", json={"inputs": PROMPT}, timeout=30).json()
    assert [token["id"] for token in tokens] == runtime.encode(PROMPT)
    assert all(PROMPT[token["start"] : token["stop"]] == token["text"] for token in tokens)
    assert tokens[-1]["stop"] == len(PROMPT)


def test_tgi_marks_special_tokens_as_special():
    from serving.api.tgi import _token
    from serving.generation import Piece

    class Tokenizer:
        def decode(self, ids):
            return "</s>" if ids == [2] else "x"

    assert _token(Piece("", 2, -0.1), {2}, Tokenizer()) == {
        "id": 2,
        "text": "</s>",
        "logprob": -0.1,
        "special": True,
    }
    assert _token(Piece("x", 5, -0.2), {2}, Tokenizer())["special"] is False


def test_huggingface_hub_client_sends_tgi_parameters(url, runtime, monkeypatch):
    from huggingface_hub import InferenceClient, constants

    monkeypatch.setattr(constants, "is_offline_mode", lambda: False)
    client = InferenceClient(model=url)
    answer = client.text_generation(
        PROMPT, max_new_tokens=5, repetition_penalty=1.1, top_n_tokens=2, details=True, truncate=10
    )
    assert len(answer.details.top_tokens) == answer.details.generated_tokens


# --- OpenAI -------------------------------------------------------------------------------------------------------


@pytest.fixture
def openai_client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_openai_content_parts_are_joined_and_other_part_types_refused_by_name(openai_client):
    import openai

    def chat(content) -> str:
        answer = openai_client.chat.completions.create(
            model="tiny/3", messages=[{"role": "user", "content": content}], max_tokens=5, temperature=0
        )
        return answer.choices[0].message.content

    parts = [{"type": "text", "text": "Where is"}, {"type": "text", "text": "the river?"}]
    assert chat(parts) == chat("Where is\nthe river?")
    with pytest.raises(openai.UnprocessableEntityError) as refused:
        chat([{"type": "image_url", "image_url": {"url": "data:,"}}])
    assert "'image_url'" in refused.value.body["message"]


def test_openai_prompt_as_token_ids_echo_and_logprobs(openai_client, runtime):
    ids = runtime.encode(PROMPT)
    by_text = openai_client.completions.create(model="tiny/3", prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = openai_client.completions.create(model="tiny/3", prompt=ids, max_tokens=6, temperature=0)
    in_list = openai_client.completions.create(model="tiny/3", prompt=[ids], max_tokens=6, temperature=0)
    assert by_text.choices[0].text == by_ids.choices[0].text == in_list.choices[0].text
    echoed = openai_client.completions.create(
        model="tiny/3", prompt=PROMPT, max_tokens=6, temperature=0, echo=True
    )
    assert echoed.choices[0].text == PROMPT + by_text.choices[0].text
    scored = openai_client.completions.create(
        model="tiny/3", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == scored.usage.completion_tokens
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert len(top) <= 2 and chosen == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_openai_chat_logprobs_streamed_equal_whole(openai_client):
    request = {
        "model": "tiny/3",
        "messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello"}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = openai_client.chat.completions.create(**request)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens and all(len(t.top_logprobs) == 3 for t in content)
    streamed = [
        token
        for chunk in openai_client.chat.completions.create(**request, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for token in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]


def test_openai_load_generator_fields_fix_the_output_length(openai_client, runtime):
    answer = openai_client.completions.create(
        model="tiny/3",
        prompt=PROMPT,
        max_tokens=10,
        extra_body={"ignore_eos": True, "min_tokens": 10, "repetition_penalty": 1.1},
        frequency_penalty=0.5,
        presence_penalty=0.5,
        stream_options=None,
    )
    assert answer.usage.completion_tokens == 10 and answer.choices[0].finish_reason == "length"


def test_openai_refusals_name_the_field_in_openai_error_shape(openai_client, url):
    import openai

    with pytest.raises(openai.UnprocessableEntityError) as refused:
        openai_client.chat.completions.create(
            model="tiny/3",
            messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_object"},
        )
    assert (
        "response_format" in refused.value.body["message"] and "json_object" in refused.value.body["message"]
    )
    text_format = openai_client.chat.completions.create(
        model="tiny/3",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert text_format.choices[0].message.content is not None
    response = httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "colour": 1}, timeout=30)
    assert response.status_code == 422 and "colour" in response.json()["error"]["message"]
    out_of_vocabulary = httpx.post(f"{url}/v1/completions", json={"prompt": [10**9]}, timeout=30)
    assert (
        out_of_vocabulary.status_code == 400 and "vocabulary" in out_of_vocabulary.json()["error"]["message"]
    )


def test_openai_several_prompts_and_n_choices_streamed_or_not(openai_client, runtime):
    prompts = [PROMPT, "The stone near the garden"]
    alone = [
        openai_client.completions.create(model="tiny/3", prompt=p, max_tokens=5, temperature=0)
        .choices[0]
        .text
        for p in prompts
    ]
    both = openai_client.completions.create(model="tiny/3", prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == alone
    assert both.usage.prompt_tokens == sum(len(runtime.encode(p)) for p in prompts)
    streamed: dict[int, str] = {0: "", 1: ""}
    for chunk in openai_client.completions.create(
        model="tiny/3", prompt=prompts, max_tokens=5, temperature=0, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == alone
    drawn = openai_client.chat.completions.create(
        model="tiny/3",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=6,
        temperature=1.9,
        seed=3,
        n=4,
    )
    texts = [choice.message.content for choice in drawn.choices]
    assert len(texts) == 4 and len(set(texts)) > 1  # seeds 3, 4, 5, 6: the choices are different draws


def test_tgi_decoder_input_details_score_the_input_and_are_refused_on_streams(url, runtime):
    from text_generation import Client

    client = Client(url, timeout=60)
    answer = client.generate(PROMPT, max_new_tokens=2, decoder_input_details=True)
    prefill = answer.details.prefill
    ids = runtime.encode(PROMPT)
    assert [token.id for token in prefill] == ids and prefill[0].logprob is None
    nll, _ = runtime.score([ids])[0]
    # the same engine's float32 logits, normalised and summed in another order: ~1e-6 apart; 1e-4 is generous
    assert sum(token.logprob for token in prefill[1:]) == pytest.approx(-nll, abs=1e-4)
    # the client's stream call has no such parameter: a raw request asks, and is refused as TGI refuses it
    body = {"inputs": PROMPT, "parameters": {"decoder_input_details": True}}
    refused = httpx.post(f"{url}/generate_stream", json=body, timeout=30)
    assert refused.status_code == 422 and "decoder_input_details" in refused.json()["error"]
    assert refused.json()["error_type"] == "validation"


def test_a_request_for_more_generations_than_the_queue_holds_is_refused_not_told_to_retry(url):
    body = {"prompt": [PROMPT] * 16, "n": 8, "max_tokens": 2}  # 128 generations, serve.max_queue is 64
    refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    assert refused.status_code == 400 and "serve.max_queue" in refused.json()["error"]["message"]


def test_a_choice_failing_unexpectedly_ends_a_merged_stream_instead_of_hanging_it():
    import asyncio

    from serving.api.openai import Choice, _merged
    from serving.text import RequestError

    class Broken:
        class request:  # noqa: N801 (the attribute the stream cancels)
            @staticmethod
            def cancel():
                pass

        async def events(self):
            raise ValueError("engine went away")
            yield  # pragma: no cover

    class Fine(Broken):
        async def events(self):
            await asyncio.sleep(0.01)
            return
            yield  # pragma: no cover

    async def drain():
        return [event async for event in _merged([Choice(0, Fine()), Choice(1, Broken())])]

    with pytest.raises(RequestError, match="ValueError"):
        asyncio.run(asyncio.wait_for(drain(), 5))


def test_the_worker_computes_token_logprobs_only_for_answers_that_report_them(
    url, openai_client, monkeypatch
):
    """A softmax over the vocabulary per token is a few per cent of a batched step: OpenAI answers compute it only
    when `logprobs` asks; TGI's streams always carry each token's logprob, its plain answers only with `details`."""
    from serving import scheduler
    from serving.sampling import logprob

    computed = []
    monkeypatch.setattr(scheduler, "logprob", lambda *args: computed.append(1) or logprob(*args))
    fixed = {"temperature": 0, "extra_body": {"ignore_eos": True}}  # every answer runs to its max_tokens
    openai_client.completions.create(model="tiny/3", prompt=PROMPT, max_tokens=4, **fixed)
    assert computed == []
    answer = openai_client.completions.create(
        model="tiny/3", prompt=PROMPT, max_tokens=4, logprobs=0, **fixed
    )
    assert len(computed) == 4 and all(v is not None for v in answer.choices[0].logprobs.token_logprobs)
    chat = openai_client.chat.completions.create(
        model="tiny/3", messages=[{"role": "user", "content": PROMPT}], max_tokens=3, logprobs=True, **fixed
    )
    assert len(computed) == 7 and len(chat.choices[0].logprobs.content) == 3
    streamed = httpx.post(
        f"{url}/generate_stream", json={"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}, timeout=60
    )
    assert streamed.status_code == 200 and '"logprob":-' in streamed.text.replace(" ", "")
    assert len(computed) == 9
    plain = {"inputs": PROMPT, "parameters": {"max_new_tokens": 2}}
    assert httpx.post(f"{url}/generate", json=plain, timeout=60).status_code == 200
    assert len(computed) == 9  # TGI's plain answer: the text only
    plain["parameters"]["details"] = True
    details = httpx.post(f"{url}/generate", json=plain, timeout=60).json()["details"]
    assert len(computed) == 9 + len(details["tokens"]) and details["tokens"][0]["logprob"] < 0
