"""TGI's request body the server accepts: generate (with or without streaming). Unknown fields are refused (422
naming them) rather than silently ignored."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serving.scheduler import Sampling

# TGI parameters the huggingface_hub client always sends (as null) that this server does not implement; any
# other value than null is refused by name.
_TGI_UNSUPPORTED = [
    "adapter_id",
    "best_of",
    "decoder_input_details",
    "frequency_penalty",
    "grammar",
    "repetition_penalty",
    "top_n_tokens",
    "truncate",
    "typical_p",
    "watermark",
]


class TgiParameters(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int | None = Field(None, ge=1)
    do_sample: bool | None = None
    temperature: float | None = Field(None, gt=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = Field(None, ge=0)
    stop: Annotated[list[str], Field(max_length=4)] | None = None
    details: bool | None = None
    return_full_text: bool | None = None
    adapter_id: Any = None
    best_of: Any = None
    decoder_input_details: Any = None
    frequency_penalty: Any = None
    grammar: Any = None
    repetition_penalty: Any = None
    top_n_tokens: Any = None
    truncate: Any = None
    typical_p: Any = None
    watermark: Any = None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> TgiParameters:
        used = [name for name in _TGI_UNSUPPORTED if getattr(self, name) not in (None, False)]
        if used:
            raise ValueError(f"not supported by this server: {', '.join(used)}")
        return self

    def stops(self) -> list[str]:
        return list(self.stop or [])

    def sampling(self) -> Sampling:
        """TGI's rule: greedy unless `do_sample`, or a temperature, top_p or top_k asks for sampling."""
        wants = self.do_sample or any(v is not None for v in (self.temperature, self.top_p, self.top_k))
        if not wants or self.do_sample is False:
            return Sampling(seed=self.seed)
        return Sampling(self.temperature or 1.0, self.top_p or 1.0, self.top_k or 0, self.seed)


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    inputs: str = Field(min_length=1)
    parameters: TgiParameters = TgiParameters()
    stream: bool = False
