"""The one error hierarchy of treepack.

Every caller mistake raises a subclass of :class:`RequestError` (itself a ``ValueError``)
whose message names the value, the rule and where, msgspec style::

    sequence longer than seq_len: got 140000 tokens, seq_len is 131072 - at `$.sequences[3]`

``path`` is a JSON-path-like location inside the request (``$.sequences[3].trainable``),
``rule`` a short machine-readable rule name. The service maps the hierarchy to HTTP in
one exception handler (:data:`HTTP_STATUS`), the client maps HTTP errors back through the
same table, so an error raised by the embedded planner and one returned by the sidecar
are the same type with the same message.

Hierarchy::

    TreepackError
    +-- RequestError (ValueError)          422  the request breaks a rule
    |   +-- InputTypeError (TypeError)     422  a value has the wrong type
    |   +-- CapacityError                  422  a sequence does not fit a row
    |   +-- DecodeError                    400  the body is not valid msgpack/JSON
    |   +-- PayloadTooLargeError           413  a configured size limit is exceeded
    |   +-- UnsupportedMediaTypeError      415  wrong Content-Type / Accept
    |   +-- UnsupportedVersionError        422  wire version this build does not speak
    |   +-- UnsupportedModelError          422  a model layer has no tree-exact path (trainer)
    |   +-- CostModelError                 422  a cost model or cost file that cannot be used
    +-- AuthError                          401  missing or wrong bearer token
    +-- OverloadedError                    503  the planner queue is full (retry later)
    +-- ServerError                        500  a bug on the server side
    +-- TransportError                     ---  the client could not reach the server

    TreepackWarning (UserWarning)                a choice that works but wastes compute or memory
    +-- NoTrainableWarning                       plan_batch given no trainable=: nothing planned as a loss target
"""

from __future__ import annotations

from treepack.proto.version import WIRE_VERSION

__all__ = [
    "TreepackError",
    "RequestError",
    "InputTypeError",
    "CapacityError",
    "DecodeError",
    "PayloadTooLargeError",
    "BodyTimeoutError",
    "ConflictError",
    "UnsupportedMediaTypeError",
    "UnsupportedVersionError",
    "UnsupportedModelError",
    "CostModelError",
    "AuthError",
    "OverloadedError",
    "ServerError",
    "DeadlineError",
    "UnavailableError",
    "TransportError",
    "HTTP_STATUS",
    "http_status",
    "error_from_payload",
    "TreepackWarning",
    "NoTrainableWarning",
]


class TreepackError(Exception):
    """Base of every error treepack raises on purpose.

    Args:
        message: what is wrong, naming the value and the rule.
        path: where, as a JSON path into the request (``$`` is the request itself).
        rule: a short machine-readable rule name (``max_len``, ``dtype``, ...).
    """

    kind = "treepack_error"

    def __init__(self, message: str, *, path: str = "$", rule: str = "") -> None:
        self.message = message
        self.path = path
        self.rule = rule or self.kind
        super().__init__(f"{message} - at `{path}`" if path else message)

    def to_payload(self) -> dict:
        """The error as the service sends it: ``{"version", "error": kind, "message", "path", "rule"}``."""
        return {
            "version": WIRE_VERSION,
            "error": self.kind,
            "message": self.message,
            "path": self.path,
            "rule": self.rule,
        }


class RequestError(TreepackError, ValueError):
    """The request breaks a documented rule (HTTP 422)."""

    kind = "invalid_request"


class InputTypeError(RequestError, TypeError):
    """A value of the request has the wrong type (HTTP 422)."""

    kind = "invalid_type"


class CapacityError(RequestError):
    """A sequence is longer than ``seq_len`` and ``on_overflow`` is ``error`` (HTTP 422)."""

    kind = "sequence_too_long"


class DecodeError(RequestError):
    """The body is not decodable msgpack/JSON (HTTP 400)."""

    kind = "malformed_body"


class PayloadTooLargeError(RequestError):
    """A configured limit (body bytes, sequences, tokens) is exceeded (HTTP 413)."""

    kind = "too_large"


class BodyTimeoutError(RequestError):
    """The request body did not arrive within the service's body timeout (HTTP 408)."""

    kind = "body_timeout"


class ConflictError(RequestError):
    """An ``Idempotency-Key`` reused for a different request (HTTP 409)."""

    kind = "conflict"


class UnsupportedMediaTypeError(RequestError):
    """Content-Type or Accept names a format the service does not speak (HTTP 415)."""

    kind = "unsupported_media_type"


class UnsupportedVersionError(RequestError):
    """The request's wire version is not one this build understands (HTTP 422)."""

    kind = "unsupported_version"


class UnsupportedModelError(RequestError):
    """A model the trainer was asked to run packed has a layer with no tree-exact path (HTTP 422).

    Raised by ``treepack.trainer.hf.check_model`` before any compute; the message names
    each refused module's path in the model, its class and the reason. ``refusals`` holds
    them as ``(path, class name, reason)`` triples.
    """

    kind = "unsupported_model"

    def __init__(self, message: str, *, path: str = "$.model", rule: str = "", refusals: tuple = ()) -> None:
        super().__init__(message, path=path, rule=rule)
        self.refusals = tuple(refusals)


class CostModelError(RequestError):
    """A cost model or cost file that cannot be used (HTTP 422): not a cost model, another
    version, or a field that breaks its rule (:mod:`treepack.proto.cost`)."""

    kind = "cost_model_error"


class AuthError(TreepackError):
    """Missing or wrong bearer token (HTTP 401)."""

    kind = "unauthorized"


class OverloadedError(TreepackError):
    """The service's planning queue is full; retry after ``retry_after`` seconds (HTTP 503)."""

    kind = "overloaded"

    def __init__(self, message: str, *, path: str = "$", rule: str = "", retry_after: float = 1.0):
        super().__init__(message, path=path, rule=rule)
        self.retry_after = retry_after

    def to_payload(self) -> dict:
        return {**super().to_payload(), "retry_after": self.retry_after}


class ServerError(TreepackError):
    """The server failed on a valid request (HTTP 5xx); a bug, please report it."""

    kind = "server_error"


class DeadlineError(TreepackError):
    """The work ran past the request's deadline, or its client went away, and was stopped (HTTP 504)."""

    kind = "deadline_exceeded"


class UnavailableError(TreepackError):
    """A part the request needs is out of order (a damaged history); ``/readyz`` says why (HTTP 503)."""

    kind = "unavailable"


class TransportError(TreepackError):
    """The client could not talk to the server (connection refused, timeout, ...)."""

    kind = "transport_error"


HTTP_STATUS: dict[type[TreepackError], int] = {
    DecodeError: 400,
    AuthError: 401,
    BodyTimeoutError: 408,
    ConflictError: 409,
    PayloadTooLargeError: 413,
    UnsupportedMediaTypeError: 415,
    CapacityError: 422,
    InputTypeError: 422,
    UnsupportedVersionError: 422,
    UnsupportedModelError: 422,
    CostModelError: 422,
    RequestError: 422,
    OverloadedError: 503,
    DeadlineError: 504,
    UnavailableError: 503,
    ServerError: 500,
}

_BY_KIND: dict[str, type[TreepackError]] = {
    cls.kind: cls
    for cls in (
        RequestError,
        InputTypeError,
        CapacityError,
        DecodeError,
        PayloadTooLargeError,
        BodyTimeoutError,
        ConflictError,
        UnsupportedMediaTypeError,
        UnsupportedVersionError,
        UnsupportedModelError,
        CostModelError,
        AuthError,
        OverloadedError,
        ServerError,
        DeadlineError,
        UnavailableError,
        TransportError,
    )
}


def http_status(err: TreepackError) -> int:
    """The HTTP status the service answers ``err`` with (most specific class wins)."""
    for cls in type(err).__mro__:
        if cls in HTTP_STATUS:
            return HTTP_STATUS[cls]
    return 500


def error_from_payload(payload: dict, status: int) -> TreepackError:
    """Rebuild the exception a server sent as ``{"error", "message", "path", "rule"}``.

    Unknown kinds map by status: 4xx to :class:`RequestError`, 503 to
    :class:`OverloadedError`, anything else to :class:`ServerError`. An
    :class:`OverloadedError` keeps the payload's ``retry_after`` (seconds).
    """
    kind = str(payload.get("error", ""))
    message = str(payload.get("message", "")) or f"HTTP {status}"
    path = str(payload.get("path", "$"))
    rule = str(payload.get("rule", ""))
    cls = _BY_KIND.get(kind)
    if cls is None:
        if status == 503:
            cls = OverloadedError
        elif status == 401:
            cls = AuthError
        elif 400 <= status < 500:
            cls = RequestError
        else:
            cls = ServerError
    if issubclass(cls, OverloadedError):
        try:
            retry_after = max(0.0, float(payload.get("retry_after", 1.0)))
        except (TypeError, ValueError):
            retry_after = 1.0
        return cls(message, path=path, rule=rule, retry_after=retry_after)
    return cls(message, path=path, rule=rule)


class TreepackWarning(UserWarning):
    """A batch, plan or backend choice that works but wastes compute or memory.

    The trainer's advice (``treepack.trainer.TreepackWarning`` is this class) and the
    planner's cost warnings (:class:`treepack.proto.cost.CostWarning`) share it, so one
    ``warnings.filterwarnings("ignore", category=TreepackWarning)`` silences all of them.
    """


class NoTrainableWarning(TreepackWarning):
    """``plan_batch`` was called without ``trainable=``: every token is planned as a
    non-target (fully shareable, no join token duplicated), which a loss on those plans
    would read wrongly. ``trainable=None`` says so on purpose and is not warned about."""
