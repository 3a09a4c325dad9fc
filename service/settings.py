"""Service settings, read from ``TREEPACK_*`` environment variables (pydantic-settings).

Every field below is also a ``treepack serve`` flag (``max_tokens`` -> ``--max-tokens``);
flags win over the environment. Nothing is read at import time: ``Settings()`` reads the
environment when called.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings", "CHOICES", "OTHER_ENVIRONMENT", "unknown_environment"]

LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DOCS = ("offline", "swagger", "off")

CHOICES: dict[str, tuple[str, ...]] = {"log_level": LOG_LEVELS, "docs": (*DOCS, "none")}
"""Settings that take one word of a list (``none`` is ``off`` for ``docs``)."""

OTHER_ENVIRONMENT = frozenset(
    {
        "TREEPACK_URL",  # treepack.client.Packer.from_env: the sidecar a trainer talks to
        "TREEPACK_VERL",  # the verl plugin's switch (treepack.trainer.verl_plugin)
        "TREEPACK_VERL_BACKEND",
        "TREEPACK_VERL_MIN_SHARED_LEN",
        "TREEPACK_VERL_MAX_SEQ_LEN",
        "TREEPACK_VERL_TAG",
        "TREEPACK_VERL_VERBOSE",
        "TREEPACK_VERL_REPORT_PARITY",
    }
)
"""``TREEPACK_*`` variables that other parts of treepack read: not settings, not warned about."""


class Settings(BaseSettings):
    """Service configuration.

    Attributes:
        host: interface to bind; loopback by default (a sidecar is reached over the
            pod's localhost only).
        port: TCP port.
        workers: uvicorn worker processes (each with its own planner pool and metrics;
            one is right for a sidecar).
        token: if set, every ``/v1/*`` and ``/metrics`` request needs
            ``Authorization: Bearer <token>`` (compared in constant time). Surrounding
            whitespace is stripped (a Secret made from a file ends in a newline); an empty
            or non-ASCII token is refused at startup.
        token_file: read the token from this file instead (stripped the same way).
        max_body_bytes: request bodies above this get 413.
        max_sequences: sequences per request above this get 413.
        max_tokens: tokens per request (and per what-if trial) above this get 413.
        max_cp_tiles: tiles of 16 tokens an all-gather context-parallel split may hold per
            plan (or per what-if trial): rows x ``cp_size`` x ``shard_len`` / 16, padding
            included (the plan carries an int32 per tile, the split works on an int64 per
            tile); above it, 413 before the split runs. Unset (the default): ``max_tokens`` / 16,
            as many positions as the largest pack holds tokens.
        max_tags: distinct task tags a request may carry: in a pack's ``tags``, in a
            what-if's inline shapes, or as ``by_tag`` keys of one composition; above it,
            413 before anything is planned or recorded (what-ifs group the pool by tag, and
            the history keeps what packs record).
        max_concurrent_plans: planner worker threads.
        whatif_max_work: tokens a what-if may plan in all: the sum over compositions of
            trials x the most tokens one trial can draw (inline shapes counted in full),
            plus one padded row per trial under an all-gather CP split; above it, 413
            before any trial. Unset (the default): 4 x ``max_tokens``, so a
            what-if never plans more than four of the largest packs allowed.
        request_timeout_s: wall-clock deadline of a pack or what-if (from admission);
            past it the planner stops between phases or trials and the answer is 504.
            Work for a client that disconnected is stopped the same way.
        intake_budget_bytes: bytes of request bodies being read or held at once, charged
            as they arrive (not as announced); a body whose bytes would pass it gets 503 +
            Retry-After, at once if the budget is already spent.
        intake_reserve_bytes: room kept beyond the budget for small bodies (announced
            sizes up to 1 MiB, or up to this if smaller): large uploads cannot starve a
            small pack.
        body_timeout_s: a request body must arrive within this many seconds (else 408).
        body_first_byte_s: a body announced by ``Content-Length`` must start arriving
            within this many seconds (else 408): a client that announces a large body and
            sends nothing is cut early.
        header_timeout_s: a connection must send a request's headers within this many
            seconds of opening (or of its previous answer), else it is closed.
        max_header_bytes: request line and headers larger than this close the
            connection (uvicorn's ``h11_max_incomplete_event_size``).
        idempotency_cache_bytes: answers kept for repeated ``Idempotency-Key`` s (oldest
            go first); ``idempotency_ttl_s``: for how long (a retry comes within seconds).
        keep_alive_s: idle keep-alive connections are closed after this (uvicorn
            ``timeout_keep_alive``).
        max_connections: open connections (and tasks) beyond this get 503 from uvicorn
            (``limit_concurrency``).
        max_queue: requests that may wait for a worker; beyond, 503 + Retry-After.
        retry_after_s: the Retry-After the service advises when overloaded.
        history_enabled: record batch shapes at all.
        history_path: SQLite file for the shape history; unset keeps it in memory
            (lost on restart).
        history_max_batches: keep at most this many recorded batches (oldest go first).
        history_max_bytes: keep at most this many bytes of recorded shapes (oldest go
            first; the newest batch is always kept).
        history_recover: at startup, move a damaged history file aside (renamed
            ``<file>.damaged-<unix time>``) and start a fresh one; without it a damaged file
            leaves the history off and ``/readyz`` not ready (packs are still served).
        history_max_age_s: drop batches older than this (``none``: no age limit).
        history_max_pending: shapes waiting for the history writer; beyond, a batch is
            not recorded (counted in ``treepack_history_skipped_total``), never delayed.
        whatif_max_trials: trials x compositions per what-if request above this get 413.
        cost_model_path: a cost file (``treepack.trainer.calibrate(...).save(path)``): every
            plan then carries ``stats.predicted_ms``, ``placement="auto"`` picks tree or
            plain packing by predicted time, and what-if answers carry ``step_ms``. A file
            that cannot be read, or whose predictions could overflow for a request the
            service accepts (:mod:`treepack.proto.cost_range`), stops the service at
            startup, naming the file and field.
        malloc_keep_mb: freed memory the server process keeps for reuse instead of
            returning it to the OS (glibc only; 0 keeps the allocator's defaults): large
            requests then reuse warm pages (:mod:`treepack.service.malloc`).
        log_level: uvicorn log level (:data:`LOG_LEVELS`).
        docs: ``offline`` (default) serves ``/docs`` as a self-contained page that lists
            the operations from ``/openapi.json``; ``swagger`` serves Swagger UI from its CDN
            (needs the network); ``off`` (or ``none``) serves no ``/docs``.
    """

    model_config = SettingsConfigDict(env_prefix="TREEPACK_", extra="ignore", frozen=True, env_parse_none_str="none")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    token: Optional[SecretStr] = None
    token_file: Optional[str] = None
    max_body_bytes: int = Field(256 * 2**20, ge=1)
    max_sequences: int = Field(262_144, ge=1)
    max_tokens: int = Field(64 * 2**20, ge=1)
    max_cp_tiles: Optional[int] = Field(None, ge=1)
    max_tags: int = Field(1024, ge=1)
    max_concurrent_plans: int = Field(2, ge=1, le=256)
    max_queue: int = Field(8, ge=0, le=10_000)
    whatif_max_work: Optional[int] = Field(None, ge=1)
    request_timeout_s: float = Field(120.0, gt=0, le=86_400)
    intake_budget_bytes: int = Field(512 * 2**20, ge=1)
    intake_reserve_bytes: int = Field(32 * 2**20, ge=0)
    body_timeout_s: float = Field(60.0, gt=0, le=3600)
    body_first_byte_s: float = Field(5.0, gt=0, le=3600)
    header_timeout_s: float = Field(10.0, gt=0, le=3600)
    max_header_bytes: int = Field(64 * 2**10, ge=1024)
    idempotency_cache_bytes: int = Field(32 * 2**20, ge=0)
    idempotency_ttl_s: float = Field(120.0, gt=0)
    keep_alive_s: int = Field(5, ge=1, le=3600)
    max_connections: int = Field(256, ge=1)
    retry_after_s: float = Field(1.0, gt=0, le=3600)
    history_enabled: bool = True
    history_path: Optional[str] = None
    history_max_batches: int = Field(1000, ge=1)
    history_max_bytes: int = Field(256 * 2**20, ge=1)
    history_recover: bool = False
    history_max_age_s: Optional[float] = Field(7 * 24 * 3600.0, gt=0)
    history_max_pending: int = Field(32, ge=1)
    whatif_max_trials: int = Field(2000, ge=1)
    cost_model_path: Optional[str] = None
    malloc_keep_mb: int = Field(256, ge=0, le=2047)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    docs: Literal["offline", "swagger", "off"] = "offline"

    @field_validator("docs", mode="before")
    @classmethod
    def _none_is_off(cls, value: Any) -> Any:
        # `none` clears every optional setting; for /docs that is no page at all.
        return "off" if value is None or (isinstance(value, str) and value.strip().lower() == "none") else value

    @property
    def whatif_work_limit(self) -> int:
        """``whatif_max_work``, or 4 x ``max_tokens`` when unset."""
        return self.whatif_max_work if self.whatif_max_work is not None else 4 * self.max_tokens

    @property
    def cp_tiles_limit(self) -> int:
        """``max_cp_tiles``, or ``max_tokens`` / 16 when unset."""
        return self.max_cp_tiles if self.max_cp_tiles is not None else max(1, self.max_tokens // 16)

    @property
    def small_body_bytes(self) -> int:
        """Bodies announced at most this large may use ``intake_reserve_bytes``."""
        return min(1 << 20, self.intake_reserve_bytes)

    @model_validator(mode="after")
    def _clean_token(self) -> Settings:
        """Strip the token (from the environment or ``token_file``); refuse an empty or non-ASCII one."""
        raw, where = None, "TREEPACK_TOKEN"
        if self.token_file is not None:
            where = f"token file {self.token_file}"
            try:
                raw = Path(self.token_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"cannot read the {where}: {exc}") from None
        elif self.token is not None:
            raw = self.token.get_secret_value()
        if raw is None:
            return self
        token = raw.strip()
        if not token:
            raise ValueError(f"the bearer token ({where}) is empty; unset it to run without a token")
        if not token.isascii() or not token.isprintable():
            raise ValueError(f"the bearer token ({where}) must be printable ASCII (HTTP headers carry nothing else)")
        object.__setattr__(self, "token", SecretStr(token))
        return self


def unknown_environment(environ: Mapping[str, str]) -> list[tuple[str, str | None]]:
    """The ``TREEPACK_*`` variables of ``environ`` that are neither a setting nor read by
    another part of treepack (:data:`OTHER_ENVIRONMENT`), each with the closest known name
    (or None), sorted.

    Args:
        environ: the environment (``os.environ``).
    """
    known = {f"TREEPACK_{n.upper()}" for n in Settings.model_fields} | OTHER_ENVIRONMENT
    rest = {k.removeprefix("TREEPACK_"): k for k in known}  # compared without the common prefix
    odd = sorted(k for k in environ if k.upper().startswith("TREEPACK_") and k.upper() not in known)
    out: list[tuple[str, str | None]] = []
    for k in odd:
        close = difflib.get_close_matches(k.upper().removeprefix("TREEPACK_"), sorted(rest), n=1, cutoff=0.75)
        out.append((k, rest[close[0]] if close else None))
    return out
