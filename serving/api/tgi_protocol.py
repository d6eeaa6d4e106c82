"""TGI's request bodies the server accepts: generate (with or without streaming) and tokenize. Unknown fields are
refused (422 naming them, in TGI's error shape) rather than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serving.sampling import Sampling
from serving.text import RequestError

MAX_TOP_N_TOKENS = 5  # TGI's default --max-top-n-tokens

# What TGI takes and this server does not do: refused by name when set (the clients send them as null)
_UNSUPPORTED = {
    "watermark": "watermarking is not supported by this server",
    "grammar": "grammar-constrained decoding is not supported by this server",
    "adapter_id": "this server serves no adapters",
}


class TgiParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(None, ge=1)
    do_sample: bool | None = None
    temperature: float | None = Field(None, gt=0.0)  # TGI asks only for a positive temperature
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    typical_p: float | None = Field(None, gt=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0)
    stop: Annotated[list[str], Field(max_length=4)] | None = None
    details: bool | None = None
    return_full_text: bool | None = None
    truncate: int | None = Field(None, ge=1)
    top_n_tokens: int | None = Field(None, ge=0, le=MAX_TOP_N_TOKENS)
    best_of: int | None = Field(
        None, ge=1, le=1, description="One sequence per request (TGI's --max-best-of 1)."
    )
    decoder_input_details: bool | None = None
    watermark: bool | None = None
    grammar: Any = None
    adapter_id: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> TgiParameters:
        used = [reason for name, reason in _UNSUPPORTED.items() if getattr(self, name) not in (None, False)]
        if used:
            raise ValueError("; ".join(used))
        return self

    def stops(self) -> list[str]:
        return list(self.stop or [])

    @property
    def prompt_logprobs(self) -> bool:
        """decoder_input_details (with details, where TGI reports them): the input tokens with their
        log-probabilities, as `details.prefill`."""
        return bool(self.decoder_input_details and self.details)

    def sampling(self) -> Sampling:
        """TGI's rule: it samples when `do_sample` is set or any warper is (a temperature other than 1, top_k,
        top_p or typical_p below 1), even with `do_sample: false`; otherwise greedy. Penalties apply either way."""
        warpers = (
            self.temperature not in (None, 1.0)
            or bool(self.top_k)
            or (self.top_p or 1.0) < 1.0
            or (self.typical_p or 1.0) < 1.0
        )
        penalties = {
            "repetition_penalty": self.repetition_penalty or 1.0,
            "frequency_penalty": self.frequency_penalty or 0.0,
            "frequency_share": True,  # TGI's rule: the share of each token in the whole sequence
            "top_logprobs": self.top_n_tokens or 0,
        }
        if not (self.do_sample or warpers):
            return Sampling(seed=self.seed, **penalties)
        return Sampling(
            self.temperature or 1.0,
            self.top_p or 1.0,
            self.top_k or 0,
            self.seed,
            typical_p=self.typical_p or 1.0,
            **penalties,
        )


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)
    parameters: TgiParameters = TgiParameters()
    stream: bool = False

    def streamed(self, stream: bool) -> GenerateRequest:
        """This request on a streaming route (`stream`), refused as TGI refuses it where it asks for the prompt's
        details, which streams do not carry."""
        if stream and self.parameters.decoder_input_details:
            raise RequestError(422, "decoder_input_details == true is not supported when streaming tokens")
        return self


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # TGI's clients send `parameters` too; tokenizing ignores them

    inputs: str = Field(min_length=1)
