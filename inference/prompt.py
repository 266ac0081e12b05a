"""Chat messages -> prompt token ids, exactly as training tokenized the inputs before an assistant reply.

Training (training.data.render_chat_pieces) tokenizes a conversation piece by piece, an assistant turn
starting with its generation prompt. The prompt for a reply is the same pieces for the messages followed
by that generation prompt: rendered here as the conversation plus an empty assistant turn, whose reply
piece is dropped. So an adapter sees at inference the very token ids it was trained on, tools included
(the template's `tools=`, as in training).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.data.examples import Message
from inference.errors import invalid
from training.chat_template import template_for, tools_problem, uses_tools
from training.data import TARGET, DatasetError, render_chat_pieces


def prompt_ids(messages: Sequence[Message], tokenizer, tools: Sequence[dict[str, Any]] = ()) -> list[int]:
    if not messages:
        raise invalid("messages must not be empty", "messages")
    template = template_for(tokenizer, tools)
    if uses_tools(messages, tools) and (problem := tools_problem(tokenizer, template)):
        raise invalid(
            f"this model's chat template cannot render tools: it {problem}",
            "tools",
            code="template_cannot_render_tools",
        )
    try:
        pieces = render_chat_pieces(
            [*messages, Message(role="assistant", content="")], tokenizer, tools or None
        )
    except DatasetError as e:
        raise invalid(f"cannot render messages with this model's chat template: {e}", "messages") from e
    # The last piece is the empty reply (its end-of-turn markup, a target) unless the template renders
    # nothing for it; everything before it ends with the generation prompt.
    if pieces and pieces[-1][1] == TARGET:
        pieces = pieces[:-1]
    return [i for ids, _ in pieces for i in ids]
