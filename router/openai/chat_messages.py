"""OpenAI's chat ``messages`` -> the gRPC request's: text messages only (a string, or text
parts joined by newlines, as vLLM joins them); ``developer`` is the ``system`` role."""

from __future__ import annotations

from tandem.proto import generation_pb2 as pb
from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.fields import json_kind
from tandem.router.validation import shown


def chat_messages(value: object) -> list[pb.ChatMessage]:
    if value is None:
        raise invalid("messages", "is required")
    if not isinstance(value, list):
        raise invalid("messages", f"must be an array of messages, got {json_kind(value)}")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise APIError(400, f"{where}: must be an object, got {json_kind(message)}", param="messages")
        for key, field in message.items():
            if key not in ("role", "content", "name") and field is not None and field != []:
                raise APIError(400, f"{where}.{shown(str(key), 40)}: is not supported (text messages only)",
                               param="messages")
        role = message.get("role")
        if not isinstance(role, str):
            raise APIError(400, f"{where}.role: must be a string, got {json_kind(role)}", param="messages")
        # OpenAI's newer name for system instructions; chat templates know only "system".
        messages.append(pb.ChatMessage(role="system" if role == "developer" else role,
                                       content=message_content(message.get("content"), where)))
    return messages


def message_content(content: object, where: str) -> str:
    """A message's content: a string, or text parts (joined by newlines, as vLLM does)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content: must be a string or an array of text parts, got "
                            f"{json_kind(content)}", param="messages")
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            raise APIError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                f"are supported", param="messages")
        texts.append(part["text"])
    return "\n".join(texts)
