"""Decoding the request bodies (bodies.py): every refusal an ApiError naming the field at fault, in words
derived from the declarations."""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any, Callable, TypeVar

import msgspec
import msgspec.inspect as mi
from msgspec import UNSET
from starlette.requests import Request

from common.errors import ApiError
from web.fields import Body

B = TypeVar("B", bound=Body)


async def read(request: Request, max_body: int) -> bytes:
    """The raw body; 413 past `max_body` bytes (read no further)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body:
        raise ApiError(413, f"request body is over the {max_body}-byte limit")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > max_body:
            raise ApiError(413, f"request body is over the {max_body}-byte limit")
    return bytes(data)


@cache
def _decoder(cls: type[B]) -> msgspec.json.Decoder[B]:
    return msgspec.json.Decoder(cls)


@cache
def _info(cls: type[Body]) -> mi.StructType:
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    return info


def decode(raw: bytes, cls: type[B]) -> B:
    """`raw` as a `cls`, or ApiError: 400 when it is not JSON, 422 (or `status_of`) naming the field at fault.

    A well-formed body is decoded in one pass by msgspec. Anything that pass
    refuses is parsed again by the standard library, so that the answer is
    exact, and what JSON allows but msgspec does not is accepted: 9.0 for the
    integer 9, duplicate keys (the last wins), lone surrogates in strings.
    """
    try:
        body = _decoder(cls).decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        data = _parse(raw)
        _prepare(data, _info(cls), "")
        try:
            body = msgspec.convert(data, cls)
        except msgspec.ValidationError as exc:
            raise _refusal(str(exc), cls, data) from None
        _rules(body, lambda: list(data))
        return body
    _rules(body, lambda: list(msgspec.json.decode(raw)))
    return body


def convert(data: dict[str, Any], cls: type[B]) -> B:
    """`data` (a form's fields: web/forms.py) as a `cls`, refused in `decode`'s words: 422 (or `status_of`)
    naming the field at fault, an unknown one included."""
    _prepare(data, _info(cls), "")
    try:
        body = msgspec.convert(data, cls)
    except msgspec.ValidationError as exc:
        raise _refusal(str(exc), cls, data) from None
    _rules(body, lambda: list(data))
    return body


def _not_a_json_constant(name: str) -> Any:
    # Python's json reads NaN, Infinity and -Infinity; JSON (RFC 8259) has no such values.
    raise ApiError(400, f"request body is not valid JSON: {name} is not a JSON value")


def _parse_int(literal: str) -> int | float:
    """A JSON integer literal as an int, or as +-inf when it is too long to convert.

    Python refuses int() past sys.get_int_max_str_digits() (4300) digits with a
    plain ValueError. No field takes a number near that long, so the literal
    becomes an infinite float, which the field's check refuses by name.
    """
    try:
        return int(literal)
    except ValueError:
        return float(literal)


# No body nests more than a few levels; deeper is refused before parsing (RFC 8259 section 9 lets a
# parser limit it), on every Python alike (3.11's parser raises RecursionError near 1,000; 3.13's goes deeper).
MAX_DEPTH = 64
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


def _too_deep(raw: bytes) -> bool:
    """Whether arrays and objects nest deeper than MAX_DEPTH outside strings (cheap when brackets are few)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return False
    depth = 0
    for byte in _STRING.sub(b'""', raw):
        if byte in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif byte in b"]}":
            depth -= 1
    return False


def _parse(raw: bytes) -> Any:
    """RFC 8259 JSON from UTF-8 bytes, or 400; nesting deeper than MAX_DEPTH is refused (section 9)."""
    if _too_deep(raw):
        raise ApiError(400, "request body is not valid JSON we can read: it is nested too deeply")
    try:
        return json.loads(raw.decode("utf-8"), parse_int=_parse_int, parse_constant=_not_a_json_constant)
    except UnicodeDecodeError as exc:
        raise ApiError(400, "request body is not UTF-8") from exc
    except RecursionError as exc:
        raise ApiError(400, "request body is not valid JSON we can read: it is nested too deeply") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc


def shown(name: str) -> str:
    """A client's field name as an answer can carry it.

    JSON lets a client write a lone surrogate ("\\ud800"); answers are UTF-8,
    which cannot hold one, so it is named by the escape the client wrote.
    """
    return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _invalid(field: str, detail: str, cls: type[msgspec.Struct] | None = None) -> ApiError:
    top = field.split(".")[0].split("[")[0]
    status = cls.status_of.get(top, 422) if cls is not None and issubclass(cls, Body) else 422
    return ApiError(status, f"{field}: {detail}", field=field)


def _unwrap(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def _prepare(data: Any, t: mi.Type, path: str) -> Any:
    """`data` made ready for `msgspec.convert` to type `t`, or 422 for its first unknown field.

    A whole float where only an integer fits becomes that integer: JSON has one
    number type, and JSON Schema's "integer" admits 9.0. Dicts are changed in place.
    """
    t = _unwrap(t)
    if isinstance(t, mi.UnionType):
        kinds = [_unwrap(m) for m in t.types]
        if (
            isinstance(data, float)
            and any(isinstance(k, mi.IntType) for k in kinds)
            and not any(isinstance(k, mi.FloatType) for k in kinds)
        ):
            return int(data) if data.is_integer() else data
        struct = next((k for k in kinds if isinstance(k, mi.StructType)), None)
        return _prepare(data, struct, path) if struct is not None and isinstance(data, dict) else data
    if isinstance(t, mi.IntType) and isinstance(data, float) and data.is_integer():
        return int(data)
    if isinstance(t, mi.ListType) and isinstance(data, list):
        return [_prepare(item, t.item_type, f"{path}[{i}]") for i, item in enumerate(data)]
    if isinstance(t, mi.StructType) and isinstance(data, dict):
        fields = {f.encode_name: f for f in t.fields}
        for key in list(data):
            name = f"{path}.{key}" if path else key
            if key not in fields:
                raise _invalid(shown(name), f"unknown field; accepted fields are {', '.join(sorted(fields))}", t.cls)
            data[key] = _prepare(data[key], fields[key].type, name)
    return data


def _refusal(message: str, cls: type[Body], data: Any) -> ApiError:
    """The ApiError for msgspec's `message` about `data`, in words derived from the declaration."""
    head, sep, tail = message.rpartition(" - at `$")
    if sep and tail.endswith("`"):
        message, path = head, tail[:-1].lstrip(".")
    else:
        path = ""
    missing = re.fullmatch(r"Object missing required field `(.+)`", message)
    if missing:
        field = f"{path}.{missing.group(1)}" if path else missing.group(1)
        return _invalid(field, "is required", cls)
    if not path:
        return ApiError(422, "request body must be a JSON object", field="body")
    t, value = _locate(_info(cls), data, path)
    detail = f"must be {_expected(t)}" if t is not None else "is not valid"
    if ", got `" not in message and isinstance(value, (int, float)) and not isinstance(value, bool):
        # Numbers only (never a client's string), and only short ones.
        shown_value = f"{value:.6g}" if isinstance(value, float) else (str(value) if -(10**24) < value < 10**24 else "")
        if shown_value:
            detail += f", got {shown_value}"
    return _invalid(path, detail, cls)


def _locate(t: mi.Type | None, data: Any, path: str) -> tuple[mi.Type | None, Any]:
    """The declared type and the value at `path` ("mix[1].weight") of `data`."""
    for step in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        t = _unwrap(t) if t is not None else None
        if isinstance(t, mi.UnionType):
            t = next((_unwrap(m) for m in t.types if isinstance(_unwrap(m), (mi.StructType, mi.ListType))), None)
        if step.startswith("["):
            index = int(step[1:-1])
            data = data[index] if isinstance(data, list) and index < len(data) else None
            t = t.item_type if isinstance(t, mi.ListType) else None
        else:
            data = data.get(step) if isinstance(data, dict) else None
            fields = {f.encode_name: f.type for f in t.fields} if isinstance(t, mi.StructType) else {}
            t = fields.get(step)
    return t, data


def _expected(t: mi.Type) -> str:
    """What a value of type `t` must be, in words ("a whole number from 1 to 9")."""
    if isinstance(t, mi.Metadata):
        title = (t.extra_json_schema or {}).get("title")
        return title if title else _expected(t.type)
    if isinstance(t, mi.IntType):
        return "a whole number" + _bounds(t)
    if isinstance(t, mi.FloatType):
        return "a number" + _bounds(t)
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(str(v) for v in t.values)
    if isinstance(t, mi.StrType):
        return "a string" + (f" of at most {t.max_length} characters" if t.max_length is not None else "")
    if isinstance(t, mi.BytesType):
        return "a file" + (f" of at most {t.max_length} bytes" if t.max_length is not None else "")
    if isinstance(t, mi.ListType):
        if t.min_length is not None and t.max_length is not None:
            return f"a list of {t.min_length} to {t.max_length} items"
        return "a list"
    if isinstance(t, mi.StructType):
        return "an object"
    if isinstance(t, mi.UnionType):
        # msgspec.inspect leaves UNSET out of a union; None is left out here.
        return " or ".join(_expected(m) for m in t.types if not isinstance(m, mi.NoneType))
    return "something else"


def _bounds(t: mi.IntType | mi.FloatType) -> str:
    low = t.ge if t.ge is not None else t.gt
    if t.gt is not None and t.le is not None:
        return f" greater than {t.gt} and at most {t.le}"
    if low is not None and t.le is not None:
        return f" from {low} to {t.le}"
    if t.gt is not None:
        return f" greater than {t.gt}"
    if t.ge is not None:
        return f" of at least {t.ge}"
    return ""


@cache
def _attrs(cls: type[Body]) -> dict[str, str]:
    """The class's attribute names by the names a body uses ("break" -> "break_")."""
    return {f.encode_name: f.name for f in _info(cls).fields}


def _rules(body: Body, order: Callable[[], list[str]]) -> None:
    """The class's `one_of` and `needs` rules; `order()` gives the body's keys in the order written."""
    cls = type(body)

    def given(encoded: str) -> bool:
        return getattr(body, _attrs(cls)[encoded]) is not UNSET

    chosen = [name for name in cls.one_of if given(name)]
    if len(chosen) > 1:
        keys = order()
        first, second = sorted(chosen, key=keys.index)[:2]
        raise _invalid(second, f"give at most one of {', '.join(cls.one_of)} (this body also has {first})", cls)
    if cls.one_required and not chosen:
        raise ApiError(422, f"give one of {', '.join(cls.one_of)}", field="body")
    needing = [
        name for name, (other, value) in cls.needs.items() if given(name) and getattr(body, _attrs(cls)[other]) != value
    ]
    if needing:
        keys = order()
        name = min(needing, key=keys.index)
        other, value = cls.needs[name]
        raise _invalid(name, f"only applies with {other}: {json.dumps(value)}", cls)
