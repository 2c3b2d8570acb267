"""Reading a request at the edge: the body and the query, each bounded before it is converted.

The session routes parse by hand (see :mod:`toolkv.sglang.http_api`), so the limits FastAPI would
not enforce anyway are enforced here, while reading: a body is never read past
:data:`MAX_BODY_BYTES`, a query value is never longer than its declaration allows when it reaches
``int()``. Every refusal is a typed :class:`~toolkv.errors.BadRequest` (400, or 413/415), never a 500.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from toolkv.core.requests import MAX_SESSION_ID, STATUS_LIMIT_MAX
from toolkv.core.requests import Request as SessionRequest
from toolkv.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType

__all__ = ["MAX_SESSION_ID", "STATUS_LIMIT_MAX", "QueryParam", "parse_body", "parse_query"]

# an integer query value is never longer than this many characters when it reaches ``int()``
MAX_INT_CHARS = 16


@dataclass(frozen=True)
class QueryParam:
    """One query parameter, declared once: the OpenAPI text and the parser both read it. The raw
    value's length is checked before it is converted, so no value reaches ``int()`` that Python
    refuses (4,301+ digits raise ValueError, which would be a 500)."""

    name: str
    kind: type[int] | type[str]
    description: str
    max_length: int
    min_length: int = 1
    minimum: int | None = None
    maximum: int | None = None
    default: int | None = None

    @classmethod
    def of(cls, kind: type[SessionRequest], name: str) -> QueryParam:
        """The query parameter of the request ``kind``'s field ``name``, from its declaration (the
        request checks the value again once it is converted: the bounds here keep ``int()`` safe)."""
        _, a, default = next(x for x in kind.args() if x[0] == name)
        if a.kind is int:
            return cls(name, int, a.description, max_length=MAX_INT_CHARS, minimum=int(a.ge or 0),
                       maximum=None if a.le is None else int(a.le), default=default)  # type: ignore[arg-type]  # fmt: skip
        assert a.kind is str and a.max_length is not None, f"{kind.__name__}.{name}: a string or an integer"
        return cls(name, str, a.description, max_length=a.max_length, min_length=a.min_length or 0)

    def schema(self) -> dict[str, Any]:
        if self.kind is int:
            out: dict[str, Any] = {"type": "integer", "minimum": self.minimum, "maximum": self.maximum}
            if self.default is not None:
                out["default"] = self.default
            return out
        return {"type": "string", "minLength": self.min_length, "maxLength": self.max_length}

    def openapi(self) -> dict[str, Any]:
        return {"name": self.name, "in": "query", "required": False, "schema": self.schema(),
                "description": self.description}  # fmt: skip

    def refusal(self) -> BadRequest:
        if self.kind is int:
            return BadRequest(
                f"{self.name} must be an integer from {self.minimum} to {self.maximum}", field=self.name
            )
        return BadRequest(
            f"{self.name} must be {self.min_length} to {self.max_length} characters", field=self.name
        )

    def parse(self, raw: str) -> int | str:
        if not self.min_length <= len(raw) <= self.max_length:
            raise self.refusal()
        if self.kind is str:
            return raw
        if not (raw.isascii() and raw.isdigit()):
            raise self.refusal()
        value = int(raw)  # at most max_length ASCII digits: int() cannot refuse it
        if (self.minimum is not None and value < self.minimum) or (
            self.maximum is not None and value > self.maximum
        ):
            raise self.refusal()
        return value


MAX_BODY_BYTES = 4096  # the largest valid body is a 512-character session id and an epoch


def require_json(request: Request) -> None:
    """Only ``application/json`` (or ``application/*+json``) bodies are read. FastAPI's own body
    binding refuses other types too; this routes parses by hand, so it must refuse them itself:
    a ``text/plain`` POST is what a browser sends cross-site without a preflight."""
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise UnsupportedMediaType(
            f"the body must be sent as application/json, not {media or 'without a content type'!r}",
            content_type=media,
        )


def too_large() -> PayloadTooLarge:
    return PayloadTooLarge(f"request body larger than {MAX_BODY_BYTES} bytes", limit=MAX_BODY_BYTES)


async def read_body(request: Request) -> bytes:
    """The body, read chunk by chunk and never past ``MAX_BODY_BYTES`` (plus the one chunk that
    crossed it): a declared ``Content-Length`` over the limit is refused before any byte is read,
    a chunked (or under-declared) body at the first chunk past the limit. A refusal leaves the
    rest unread; the server drops it with the connection."""
    declared = request.headers.get("content-length")
    if declared is not None:
        declared = declared.strip()
        if not (declared.isascii() and declared.isdigit()) or len(declared) > 20:
            raise BadRequest("Content-Length is not a byte count")
        if int(declared) > MAX_BODY_BYTES:
            raise too_large()
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > MAX_BODY_BYTES:
            raise too_large()
    return bytes(buf)


async def parse_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, read within the limits (the route's request type checks its
    fields: ``toolkv.core.requests.Request.from_body``)."""
    require_json(request)
    raw = await read_body(request)
    try:
        data = json.loads(raw) if raw else None
    except RecursionError:  # deeply nested arrays/objects: the decoder recurses per level
        raise BadRequest("request body is nested too deeply") from None
    except ValueError:
        raise BadRequest("request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    return data


def parse_query(request: Request, *params: QueryParam) -> dict[str, Any]:
    """The route's query parameters, each parsed by its declaration; unknown or repeated ones refused."""
    q = request.query_params
    by_name = {p.name: p for p in params}
    extra = set(q) - set(by_name)
    if extra:
        raise BadRequest(f"unknown query parameter(s) {sorted(extra)[:8]}")
    out: dict[str, Any] = {}
    for name, p in by_name.items():
        values = q.getlist(name)
        if len(values) > 1:
            raise BadRequest(f"{name} given more than once", field=name)
        if values:
            out[name] = p.parse(values[0])
    return out
