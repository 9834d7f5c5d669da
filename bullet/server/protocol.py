"""Request bodies of the OpenAI-compatible routes (vLLM's shapes), validated strictly: a wrong type or value
is a :class:`BadRequest` naming the field. Fields the server does not implement are refused when they ask
for something other than their default (``n``, ``logprobs``, ``echo``, penalties, ...); unknown fields are
ignored, as vLLM does."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

INT64 = 2**63


class BadRequest(ValueError):
    """Client input the server refuses; ``status`` is the HTTP code (400 unless said), ``param`` the field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False
    continuous_usage_stats: bool = False


# field -> its only supported values (anything else is refused by name)
_UNSUPPORTED: dict[str, tuple] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False, 0),
    "top_logprobs": (None, 0), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "suffix": (None, ""), "logit_bias": (None, {}),
    "tools": (None, []), "min_tokens": (None, 0), "use_beam_search": (None, False),
}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1, lt=INT64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's extra: the prompt's and each chunk's token ids in the response
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, str):
            v = [v]
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    def stops(self) -> list[str]:
        return list(self.stop or ())


class CompletionRequest(_Sampling):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            v = v[0]  # a batch of one prompt
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        raise ValueError("must be a string or a list of token ids (or a list holding one of those: only one "
                         "prompt per request is supported)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None

    def text(self, where: str) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 "supported", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, lt=INT64)
    add_generation_prompt: bool = True

    def chat(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text(f"messages[{i}]")} for i, m in enumerate(self.messages)]

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)  # as the chat route asks (else a 500 there)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], body: bytes) -> Any:
    """The JSON ``body`` as ``model``; BadRequest naming the field otherwise."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(data).__name__}")
    for name, allowed in _UNSUPPORTED.items():
        if name in data and not any(data[name] == a and type(data[name]) is type(a) for a in allowed):
            raise BadRequest(f"{name}: only {allowed[1]!r} is supported, got {_short(data[name])}", name)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise BadRequest(_describe(e), _field(e.errors()[0]["loc"])) from None
    except RecursionError:
        raise BadRequest("the body is nested too deeply") from None


def _field(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" not in part and "-" not in part:  # skip union member tags such as 'list[str]'
            out += ("." if out else "") + part
    return out or "body"


def _describe(e: ValidationError) -> str:
    errs = e.errors()
    shown = "; ".join(f"{_field(x['loc'])}: {x['msg']}" for x in errs[:3])
    return shown + (f" (and {len(errs) - 3} more)" if len(errs) > 3 else "")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
