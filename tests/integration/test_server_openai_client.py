"""The official ``openai`` Python client against a real ``specpair-runtime serve`` process.

Each feature the SDKs and common frameworks send (issue 10, item 7) is used
through the client, the way an application would.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.server_harness import subprocess_server, wait_until_ready, write_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEY = "sk-specpair-test-0001"
MODEL = "tiny"


@pytest.fixture(scope="module")
def client(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    root = tmp_path_factory.mktemp("openai")
    (root / "key").write_text(KEY)
    config = write_config(root / "config.yaml", *pair, serving={"apiKeyFile": str(root / "key")})
    with subprocess_server(config, root / "server.log") as server:
        assert wait_until_ready(server.base_url)["ready"], server.log()
        with openai.OpenAI(
            base_url=f"{server.base_url}/v1", api_key=KEY, max_retries=0, timeout=120
        ) as sdk:
            yield sdk


def chat(client: openai.OpenAI, messages: list[Any], **fields: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=4, temperature=0, **fields
    )


def test_models_list_and_retrieve(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model"
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    assert error.value.code == "model_not_found"


def test_completion_with_seed_and_user(client: openai.OpenAI) -> None:
    def sample() -> Any:
        return client.completions.create(
            model=MODEL, prompt="Hello, how can I help", max_tokens=8, temperature=1.0,
            seed=1234, user="alice",
        )  # fmt: skip

    first, second = sample(), sample()
    assert first.choices[0].text == second.choices[0].text  # the seed fixes the sample
    assert first.usage is not None and first.usage.completion_tokens >= 1


def test_chat_stream_with_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello"}],
            max_completion_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert 1 <= usage_chunk.usage.completion_tokens <= 5
    details = usage_chunk.usage.prompt_tokens_details  # OpenAI's type parses ours
    assert details is not None and details.cached_tokens is not None
    assert 0 <= details.cached_tokens < usage_chunk.usage.prompt_tokens
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = chat(client, [{"role": "user", "content": "Hello"}])
    assert reply.choices[0].message.content.startswith(text[:1])


def test_max_completion_tokens_bounds_the_reply(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Count to one hundred"}],
        max_completion_tokens=2,
        temperature=0,
    )
    assert reply.usage is not None and reply.usage.completion_tokens <= 2


def test_text_content_parts_and_the_developer_role(client: openai.OpenAI) -> None:
    plain = chat(client, [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Hello\nthere"}])  # fmt: skip
    parts = chat(
        client,
        [
            {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
            {"role": "user", "content": [{"type": "text", "text": "Hello"},
                                         {"type": "text", "text": "there"}]},
        ],
    )  # fmt: skip
    # Parts are joined by newlines and developer means system: the same prompt.
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.choices[0].message.content == plain.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])  # fmt: skip
    assert error.value.param is not None and error.value.param.startswith("messages[0].content")


def test_penalties_pass_and_out_of_range_ones_are_refused_by_name(client: openai.OpenAI) -> None:
    reply = chat(client, [{"role": "user", "content": "Hi"}],
                 presence_penalty=0.5, frequency_penalty=-0.5)  # fmt: skip
    assert reply.choices[0].finish_reason in ("length", "stop")
    for field in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, [{"role": "user", "content": "Hi"}], **{field: 2.5})
        assert error.value.param == field


def test_logprobs_parse_into_the_sdk_types(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    reply = chat(client, messages, logprobs=True, top_logprobs=2)
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == reply.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs.content)
    streamed = [
        entry
        for chunk in chat(client, messages, logprobs=True, stream=True)
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in logprobs.content]
    completion = client.completions.create(
        model=MODEL, prompt="def add(a, b):", max_tokens=4, temperature=0, logprobs=1
    )
    legacy = completion.choices[0].logprobs
    assert legacy is not None and legacy.token_logprobs is not None
    assert completion.usage is not None
    assert len(legacy.token_logprobs) == completion.usage.completion_tokens
