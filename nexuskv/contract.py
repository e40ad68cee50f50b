"""Base class of every versioned contract: frozen, strict, validated on construction.

Contracts are pydantic models because they are validated wherever they are built (an adapter
building a descriptor gets the same field-named error as a stream worker decoding one) and
because their JSON Schemas are exported for consumers in other languages. Unknown fields are
rejected: a contract that gains a field gets a new schema version, so a reader never silently
drops something it does not understand (compatibility fails closed).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, WithJsonSchema

from nexuskv.errors import ContractError

__all__ = ["Contract", "Key128", "contract_error", "key_hex", "validate_contract"]

C = TypeVar("C", bound="Contract")


class Contract(BaseModel):
    """A frozen, strictly validated value that may cross a process boundary.

    Validating untrusted data (:meth:`model_validate`, :meth:`model_validate_json`, the topic
    codec) raises :class:`~nexuskv.errors.ContractError` naming the offending field. Building a
    value in code raises pydantic's ``ValidationError`` (a ``ValueError``), which names it too:
    pydantic calls ``__init__`` for nested models when it is overridden, so it is left alone.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="forbid",
        strict=False,
        validate_default=True,
        use_enum_values=False,
        ser_json_inf_nan="strings",
    )

    @classmethod
    def model_validate(cls: type[C], obj: Any, **kwargs: Any) -> C:  # type: ignore[override]
        try:
            return super().model_validate(obj, **kwargs)
        except pydantic.ValidationError as exc:
            raise contract_error(exc) from None

    @classmethod
    def model_validate_json(cls: type[C], json_data: str | bytes | bytearray, **kwargs: Any) -> C:  # type: ignore[override]
        try:
            return super().model_validate_json(json_data, **kwargs)
        except pydantic.ValidationError as exc:
            raise contract_error(exc) from None


def contract_error(exc: pydantic.ValidationError) -> ContractError:
    """Turn pydantic's error list into one ContractError naming the first offending field."""
    errors = exc.errors()
    first = errors[0]
    path = ".".join(str(p) for p in first.get("loc", ())) or "<root>"
    msg = str(first.get("msg", "invalid"))
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    suffix = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    err = ContractError(f"{exc.title}.{path}: {msg}{suffix}")
    err.path = path
    return err


def validate_contract(cls: type[C], data: Any) -> C:
    """Validate plain data into ``cls``, raising ContractError (never pydantic's error type)."""
    return cls.model_validate(data)


_HEX_KEY = re.compile(r"[0-9a-f]{1,32}")


def key_hex(key: int) -> str:
    """A 128-bit key as JSON carries it: 32 lowercase hex digits (JSON numbers lose precision past 2**53)."""
    return f"{key:032x}"


def _key_in(value: Any) -> Any:
    if isinstance(value, str):
        if not _HEX_KEY.fullmatch(value):
            raise ValueError("a 128-bit key is 1 to 32 lowercase hex digits")
        return int(value, 16)
    return value  # an int (built in code, or a record written before keys were hex): range-checked below


#: A canonical 128-bit key: an int in Python; in JSON (and msgpack contracts' JSON form) a
#: lowercase hex string of 32 digits, so Go and JavaScript consumers read it losslessly. Input
#: takes the hex string, or an int (records written before keys were hex still decode).
Key128 = Annotated[
    int,
    BeforeValidator(_key_in),
    Field(ge=0, lt=2**128),
    PlainSerializer(key_hex, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": "^[0-9a-f]{32}$",
                    "description": "a 128-bit key, 32 lowercase hex digits"}, mode="serialization"),
    WithJsonSchema({"anyOf": [{"type": "string", "pattern": "^[0-9a-f]{1,32}$"},
                              {"type": "integer", "minimum": 0, "maximum": 2**128 - 1}],
                    "description": "a 128-bit key, lowercase hex (an integer is read too)"}, mode="validation"),
]
