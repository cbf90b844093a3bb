"""The base of every request body: unknown fields refused, types strict, null means default.

Shared by the request models of ``schemas.py``, ``tools.py`` and
``structured.py``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, model_validator


def _valid_unicode(value: str) -> str:
    """Refuse lone surrogates: JSON can carry them, UTF-8 (and the tokenizer) cannot."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(
            f"contains a lone UTF-16 surrogate at character {error.start}; "
            "text must be valid Unicode"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]


class RequestModel(BaseModel):
    """The base of every request body and its parts: unknown fields and loose types refused.

    ``strict``: no coercion between JSON types (pydantic's strict mode still
    takes an integer for a float). A ``null`` for a field with a non-null
    default reads as the default: OpenAI's parameters are nullable.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        defaulted = {
            name
            for name, field in cls.model_fields.items()
            if not field.is_required() and field.default is not None
        }
        return {k: v for k, v in data.items() if v is not None or k not in defaulted}
