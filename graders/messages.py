"""Model graders' `input`: chat messages whose text (and image URLs) are templates, turned into
chat-completions messages per sample. Content is a string, one part, or a list of strings and parts
(input_text, output_text, input_image, input_audio), as the openai SDK's grader types declare it. Text-only
content becomes one string (parts joined by newlines), which every chat server takes; images and audio
become chat-completions content parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from graders.errors import GraderError
from graders.fields import JsonFields
from graders.templates import Template

ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class Part:
    """`kind` "text" (template: text), "image" (template: the URL) or "audio" (data, format as given)."""

    kind: str
    template: Template | None
    raw: dict[str, Any]  # the part as given, echoed by to_json

    def render(self, sample: dict[str, Any], item: dict[str, Any]) -> str | dict[str, Any]:
        if self.kind == "text":
            assert self.template is not None
            return self.template.render(sample, item)
        if self.kind == "image":
            assert self.template is not None
            image: dict[str, Any] = {"url": self.template.render(sample, item)}
            if self.raw.get("detail") is not None:
                image["detail"] = self.raw["detail"]
            return {"type": "image_url", "image_url": image}
        return {"type": "input_audio", "input_audio": dict(self.raw["input_audio"])}


@dataclass(frozen=True)
class Message:
    role: str
    content: Any  # as given (echoed)
    parts: tuple[Part, ...]
    typed: bool  # "type": "message" was given

    def render(self, sample: dict[str, Any], item: dict[str, Any]) -> dict[str, Any]:
        rendered = [part.render(sample, item) for part in self.parts]
        if all(isinstance(part, str) for part in rendered):
            return {"role": self.role, "content": "\n".join(rendered)}  # type: ignore[arg-type]
        content = [{"type": "text", "text": part} if isinstance(part, str) else part for part in rendered]
        return {"role": self.role, "content": content}

    def to_json(self) -> dict[str, Any]:
        out = {"role": self.role, "content": self.content}
        return {**out, "type": "message"} if self.typed else out


def parse_messages(value: Any, param: str) -> tuple[Message, ...]:
    if not isinstance(value, list) or not value:
        raise GraderError("invalid_grader", f"{param} must be a non-empty list of messages", param)
    return tuple(_message(JsonFields(entry, f"{param}.{index}")) for index, entry in enumerate(value))


def _message(fields: JsonFields) -> Message:
    fields.only(("role", "content", "type"))
    role = fields.choice("role", ROLES, "invalid_grader")
    if fields.has("type") and fields.obj["type"] != "message":
        raise GraderError("invalid_grader", f"{fields.at('type')} must be 'message'", fields.at("type"))
    content = fields.required("content")
    entries = content if isinstance(content, list) else [content]
    if not entries:
        raise GraderError("invalid_grader", f"{fields.at('content')} is empty", fields.at("content"))
    params = [
        f"{fields.at('content')}.{i}" if isinstance(content, list) else fields.at("content")
        for i in range(len(entries))
    ]
    parts = tuple(_part(entry, param) for entry, param in zip(entries, params, strict=True))
    return Message(role, content, parts, fields.has("type"))


def _part(entry: Any, param: str) -> Part:
    if isinstance(entry, str):
        return Part("text", Template.parse(entry, param), {"type": "input_text", "text": entry})
    fields = JsonFields(entry, param)
    kind = fields.choice("type", (*_TEXT_PARTS, "input_image", "input_audio"), "invalid_grader")
    if kind in _TEXT_PARTS:
        fields.only(("type", "text"))
        return Part("text", Template.parse(fields.string("text"), fields.at("text")), entry)
    if kind == "input_image":
        fields.only(("type", "image_url", "detail"))
        if fields.has("detail"):
            fields.choice("detail", ("auto", "low", "high"), "invalid_grader")
        return Part("image", Template.parse(fields.string("image_url"), fields.at("image_url")), entry)
    fields.only(("type", "input_audio"))
    audio = JsonFields(fields.required("input_audio"), fields.at("input_audio"))
    audio.only(("data", "format"))
    audio.string("data")
    audio.choice("format", ("mp3", "wav"), "invalid_grader")
    return Part("audio", None, entry)
