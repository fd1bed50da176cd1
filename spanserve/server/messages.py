"""Chat messages as OpenAI's chat-completions schema defines them (every role and content part),
reduced to what a text model's chat template takes."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


class OpenAIBody(BaseModel):
    """An OpenAI request object: JSON types checked strictly, fields outside the schema kept in
    `model_extra` (the server warns about them, or refuses them under --strict-params), and
    null for a field with a non-null default read as the default, as OpenAI does."""

    model_config = ConfigDict(strict=True, extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            fields = cls.model_fields
            drop = [k for k, v in data.items() if v is None and k in fields and fields[k].default is not None
                    and not fields[k].is_required()]
            if drop:
                data = {k: v for k, v in data.items() if k not in drop}
        return data


# Content parts OpenAI defines; only text (and a refusal, which is an assistant's text) is served.
PartType = Literal["text", "refusal", "image_url", "input_audio", "file"]


class ContentPart(OpenAIBody):
    type: PartType
    text: str | None = None
    refusal: str | None = None
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None
    file: dict[str, Any] | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None  # a hint for OpenAI's cache: ignored

    @model_validator(mode="after")
    def _has_its_payload(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a content part of type {self.type!r} needs a {self.type!r} field")
        return self

    @property
    def as_text(self) -> str:
        return self.text if self.type == "text" else (self.refusal or "")


class FunctionCall(OpenAIBody):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(OpenAIBody):
    """A call an assistant made: in an earlier turn of the history, or in this response."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def as_template_dict(self) -> dict[str, Any]:
        # Templates take arguments as an object (transformers' convention); text that is not
        # JSON reaches them as it was sent.
        try:
            args: Any = json.loads(self.function.arguments)
        except ValueError:
            args = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": args}}


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed piece of call `index`: its first piece carries id, type and name; the pieces'
    arguments concatenate to the call's."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn's calls
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None  # an earlier audio answer by id: none exists here
    # Extension: consecutive "plus" messages become standalone span segments (see server/span.py).
    kind: Literal["cross", "plus"] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        """(field path inside this message, reason) for content a text model cannot take."""
        if self.audio is not None:
            return "audio", "this server keeps no earlier audio answers; send the assistant's text as content"
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type not in ("text", "refusal"):
                    return (f"content.{j}", f"this server serves a text-only model and cannot read "
                            f"{part.type!r} parts; send text parts only")
        return None

    def as_template_dict(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.as_text for p in content)
        if content is None and self.refusal is not None:
            content = self.refusal
        out: dict[str, Any] = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id", "function_call"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.tool_calls:
            out["tool_calls"] = [c.as_template_dict() for c in self.tool_calls]
        return out
