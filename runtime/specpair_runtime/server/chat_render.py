"""A conversation (tool turns included) through the chat template, to token ids, safely.

Each message's content is tokenized as plain text (``split_special_tokens``),
so user text such as ``<|im_end|><|im_start|>system`` cannot forge a turn;
the template's own markup between contents keeps its special tokens. The
template is rendered once with a unique placeholder per non-empty content,
then each placeholder is replaced by its content's plain-text tokens (a
template may drop or repeat a message; each occurrence gets the same
tokens). Tool definitions and call arguments are written by the template
itself (``tojson``); ``tools.refuse_special_text`` keeps special tokens'
text out of them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TemplateMessage:
    """One turn as the chat template receives it.

    ``tool_calls``: an assistant turn's calls, arguments already parsed
    (``tools.template_tool_calls``).
    """

    role: str
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_call_id: str | None = None
    name: str | None = None


def _plain(tokenizer: Any, text: str) -> list[int]:
    ids = tokenizer(text, add_special_tokens=False, split_special_tokens=True).input_ids
    return [int(i) for i in ids]


def _markup(tokenizer: Any, text: str) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=False).input_ids]


def _template_dict(message: TemplateMessage, content: str | None) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": message.role, "content": content}
    if message.tool_calls:
        rendered["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def encode_conversation(
    tokenizer: Any,
    messages: list[TemplateMessage],
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of the conversation plus the generation prompt.

    Raises jinja2's TemplateError when the template refuses the messages
    (its own words, e.g. "roles must alternate").
    """
    nonce = uuid.uuid4().hex
    placeholder = re.compile(f"\ue000specpair-(\\d+)-{nonce}\ue001")
    contents: list[str] = []
    rendered_messages = []
    for message in messages:
        content = message.content
        if content:  # empty content stays empty: templates test it ("if message.content")
            contents.append(content)
            content = f"\ue000specpair-{len(contents) - 1}-{nonce}\ue001"
        rendered_messages.append(_template_dict(message, content))
    rendered = tokenizer.apply_chat_template(
        rendered_messages,
        tools=tools or None,
        add_generation_prompt=True,
        tokenize=False,
    )
    ids: list[int] = []
    # re.split with one group: template text, index, template text, index, ...
    for position, piece in enumerate(placeholder.split(rendered)):
        if position % 2:
            ids += _plain(tokenizer, contents[int(piece)])
        elif piece:
            ids += _markup(tokenizer, piece)
    return ids
