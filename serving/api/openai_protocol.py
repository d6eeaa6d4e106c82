"""OpenAI's request bodies the server accepts: completions and chat completions. Unknown fields are refused (422
naming them) rather than silently ignored. Besides OpenAI's own fields it takes the extensions vLLM takes and
load generators send (`top_k`, `min_tokens`, `ignore_eos`, `repetition_penalty`)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from serving.sampling import Sampling

Stops = str | Annotated[list[str], Field(max_length=4)] | None
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat; completions take 5
MAX_CHOICES = 8  # n per prompt
MAX_PROMPTS = 16  # prompts in one completions request


class OpenAISampling(BaseModel):
    """Fields shared by both OpenAI endpoints."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: Stops = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices per prompt.")
    user: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False

    def sampling(self) -> Sampling:
        return Sampling(
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            min_tokens=self.min_tokens,
            top_logprobs=self.top_logprob_count,
        )

    @property
    def top_logprob_count(self) -> int:
        return 0

    @property
    def token_logprobs(self) -> bool:
        """Whether the answer reports each token's log-probability (`logprobs` of either endpoint)."""
        asked = getattr(self, "logprobs", None)
        return asked is not None and asked is not False

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(OpenAISampling):
    """`prompt` is text or token ids, or a list of either (one choice per prompt, times `n`); `logprobs` asks for
    the n most likely tokens' log-probabilities at each generated token; `echo` puts the prompt before the answer,
    and with `logprobs` scores it (with `max_tokens: 0`, only that: an evaluation harness's loglikelihood request)."""

    prompt: (
        str | list[int] | Annotated[list[str] | list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    max_tokens: int = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        prompts = (
            prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        )
        if not prompts or any(not one for one in prompts):
            raise ValueError("prompt must not be empty")
        return prompts

    @model_validator(mode="after")
    def _nothing_to_answer(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 generates nothing; it is for scoring a prompt with echo: true")
        return self

    @property
    def prompt_logprobs(self) -> bool:
        """echo + logprobs: the prompt's own log-probabilities (what evaluation harnesses score with)."""
        return self.echo and self.logprobs is not None

    @property
    def top_logprob_count(self) -> int:
        return self.logprobs or 0


class _TextOnly(BaseModel):
    """A part whose `type` must be "text"; any other is refused with `REFUSAL` (formatted with the type)."""

    REFUSAL: ClassVar[str]
    type: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, kind: str) -> str:
        if kind != "text":
            raise ValueError(cls.REFUSAL.format(kind=kind))
        return kind


class TextPart(_TextOnly):
    model_config = ConfigDict(extra="forbid")
    REFUSAL: ClassVar[str] = (
        "content parts of type {kind!r} are not supported: this model reads text parts only"
    )

    text: str = ""


class ChatMessage(BaseModel):
    """A message; `content` as text or as OpenAI's list of parts (text parts are joined by newlines, as vLLM
    joins them); `developer` is OpenAI's newer name for `system`."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def template_message(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ResponseFormat(_TextOnly):
    model_config = ConfigDict(extra="allow")
    REFUSAL: ClassVar[str] = "response_format {kind!r} is not supported: this server generates free text only"


class ChatRequest(OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None

    def token_budget(self, server_cap: int) -> int:
        asked = self.max_completion_tokens or self.max_tokens
        return min(asked or server_cap, server_cap)

    @property
    def top_logprob_count(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0
