"""multipart/form-data bodies (RFC 7578) read into memory, bounded, and made a declared Body (bodies.py).

A form is parsed from the bytes of its body, never spooled to disk: the
bodies it takes are small (a recording of at most a few MB and a line of
text). Its fields become a dict of the declaration's field types (bytes for
a bytes field, UTF-8 text for the others) and are checked as a JSON body is
(decoding.convert): a refusal names the field at fault.
"""

from __future__ import annotations

from dataclasses import dataclass
from email.message import Message
from email.utils import collapse_rfc2231_value
from typing import TypeVar

import msgspec.inspect as mi
from starlette.requests import Request

from common.errors import ApiError, invalid
from web import decoding
from web.fields import Body

B = TypeVar("B", bound=Body)
FORM = "multipart/form-data"
# More parts than a form's fields is not a form of ours; the bound keeps a body of empty parts cheap.
MAX_PARTS = 16
# Bytes of headers a part may have (its name, file name and type take a few dozen).
MAX_HEADERS = 8 * 1024


@dataclass(frozen=True)
class Part:
    """One field of a form: its name, its bytes, and the file name and type a client gave (files only)."""

    name: str
    data: bytes
    filename: str | None = None
    content_type: str | None = None


def is_form(request: Request) -> bool:
    """Does the request's Content-Type say multipart/form-data?"""
    return request.headers.get("content-type", "").split(";")[0].strip().lower() == FORM


async def read(request: Request, limit: int, field: str) -> bytes:
    """The raw body; 413 naming `field` (what makes a form big) past `limit` bytes, reading no further."""
    declared = request.headers.get("content-length")
    too_big = ApiError(413, f"{field}: the form is over its {limit}-byte limit", field=field)
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_big
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise too_big
    return bytes(data)


def boundary(content_type: str) -> bytes:
    """The boundary a multipart Content-Type declares; 400 when it has none (or one RFC 2046 forbids)."""
    header = Message()
    header["content-type"] = content_type
    value = header.get_param("boundary")
    if not isinstance(value, str) or not 1 <= len(value) <= 70 or not value.isascii():
        raise ApiError(400, "a multipart/form-data body needs a boundary of 1 to 70 ASCII characters in Content-Type")
    return value.encode("ascii")


def parts(body: bytes, content_type: str) -> list[Part]:
    """The parts of a multipart/form-data `body`, in order; 400 when it is not one."""
    delimiter = b"--" + boundary(content_type)
    start = body.find(delimiter)
    if start < 0 or (start > 0 and body[start - 2 : start] != b"\r\n"):
        raise ApiError(400, "the body is not multipart/form-data: its boundary is not in it")
    found: list[Part] = []
    pos = start + len(delimiter)
    while not body.startswith(b"--", pos):
        # A delimiter line may end in white space (RFC 2046's transport padding), then CRLF.
        eol = body.find(b"\r\n", pos)
        if eol < 0 or body[pos:eol].strip(b" \t"):
            raise ApiError(400, "the body is not multipart/form-data: a boundary line is malformed")
        end = body.find(b"\r\n" + delimiter, eol)
        if end < 0:
            raise ApiError(400, "the body is not multipart/form-data: its last part has no closing boundary")
        found.append(_part(body[eol + 2 : end]))
        if len(found) > MAX_PARTS:
            raise ApiError(400, f"the form has more than {MAX_PARTS} parts")
        pos = end + 2 + len(delimiter)
    return found


def _part(raw: bytes) -> Part:
    """One part: its headers (up to a blank line), then its bytes."""
    if raw.startswith(b"\r\n"):
        head, data = b"", raw[2:]
    else:
        cut = raw.find(b"\r\n\r\n", 0, MAX_HEADERS)
        if cut < 0:
            raise ApiError(400, "a part of the form has no end to its headers (or headers over 8 KB)")
        head, data = raw[:cut], raw[cut + 4 :]
    headers = Message()
    for line in head.decode("utf-8", "replace").split("\r\n"):
        key, colon, value = line.partition(":")
        if not colon:
            raise ApiError(400, "a part of the form has a header line without a colon")
        headers[key.strip()] = value.strip()
    if (headers.get("content-disposition") or "").split(";")[0].strip().lower() != "form-data":
        raise ApiError(400, 'each part of the form needs "Content-Disposition: form-data; name=..."')
    name, filename = (_param(headers, key) for key in ("name", "filename"))
    if not name:
        raise ApiError(400, "a part of the form has no name")
    return Part(name=name, data=data, filename=filename, content_type=headers.get("content-type"))


def _param(headers: Message, key: str) -> str | None:
    """A parameter of a part's Content-Disposition, RFC 2231's encoded form (name*=utf-8''...) read too."""
    value = headers.get_param(key, header="content-disposition")
    return None if value is None else collapse_rfc2231_value(value)


def fields(found: list[Part], cls: type[B]) -> B:
    """The form's parts as a `cls`: bytes fields take a part's bytes, the others its text (UTF-8). 413 naming a
    file over its declared length; 422 naming a field given twice, or not UTF-8 text, or what `cls` refuses
    (decoding.convert)."""
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    # Each file field's most bytes (None: no limit).
    binary = {
        f.encode_name: getattr(_unwrapped(f.type), "max_length", None)
        for f in info.fields
        if isinstance(_unwrapped(f.type), mi.BytesType)
    }
    data: dict[str, object] = {}
    for part in found:
        if part.name in data:
            raise invalid(decoding.shown(part.name), "is given twice in the form")
        if part.name in binary:
            most = binary[part.name]
            if most is not None and len(part.data) > most:
                raise ApiError(413, f"{part.name}: the file is over its {most}-byte limit", field=part.name)
            data[part.name] = part.data
            continue
        try:
            data[part.name] = part.data.decode("utf-8")
        except UnicodeDecodeError:
            raise invalid(decoding.shown(part.name), "must be UTF-8 text") from None
    return decoding.convert(data, cls)


def _unwrapped(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t
