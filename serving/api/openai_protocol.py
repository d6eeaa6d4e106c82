"""OpenAI's request bodies the server accepts: completions and chat completions. Unknown fields are refused (422
naming them) rather than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from serving.scheduler import Sampling

Stops = str | Annotated[list[str], Field(max_length=4)] | None


class OpenAISampling(BaseModel):
    """Fields shared by both OpenAI endpoints (`top_k` is the extension vLLM also takes, via `extra_body`)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: Stops = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=1, description="One choice per request.")
    user: str | None = None

    def sampling(self) -> Sampling:
        return Sampling(self.temperature, self.top_p, self.top_k, self.seed)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(OpenAISampling):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int = Field(16, ge=1)

    @field_validator("prompt")
    @classmethod
    def _one_non_empty_prompt(cls, prompt: str | list[str]) -> str:
        text = prompt if isinstance(prompt, str) else prompt[0]
        if not text:
            raise ValueError("prompt must not be empty")
        return text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def token_budget(self, server_cap: int) -> int:
        asked = self.max_completion_tokens or self.max_tokens
        return min(asked or server_cap, server_cap)
