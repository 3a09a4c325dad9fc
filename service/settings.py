"""Service settings, read from ``TREEPACK_*`` environment variables (pydantic-settings).

Every field below is also a ``treepack serve`` flag (``max_tokens`` -> ``--max-tokens``);
flags win over the environment. Nothing is read at import time: ``Settings()`` reads the
environment when called.
"""

from __future__ import annotations

from typing import Optional

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Service configuration.

    Attributes:
        host: interface to bind; loopback by default (a sidecar is reached over the
            pod's localhost only).
        port: TCP port.
        workers: uvicorn worker processes (each with its own planner pool and metrics;
            one is right for a sidecar).
        token: if set, every ``/v1/*`` and ``/metrics`` request needs
            ``Authorization: Bearer <token>`` (compared in constant time).
        max_body_bytes: request bodies above this get 413.
        max_sequences: sequences per request above this get 413.
        max_tokens: tokens per request (and per what-if trial) above this get 413.
        max_concurrent_plans: planner worker threads.
        max_queue: requests that may wait for a worker; beyond, 503 + Retry-After.
        retry_after_s: the Retry-After the service advises when overloaded.
        history_enabled: record batch shapes at all.
        history_path: SQLite file for the shape history; unset keeps it in memory
            (lost on restart).
        history_max_batches: keep at most this many recorded batches (oldest go first).
        history_max_age_s: drop batches older than this (``none``: no age limit).
        history_max_pending: shapes waiting for the history writer; beyond, a batch is
            not recorded (counted in ``treepack_history_skipped_total``), never delayed.
        whatif_max_trials: trials x compositions per what-if request above this get 413.
        malloc_keep_mb: freed memory the server process keeps for reuse instead of
            returning it to the OS (glibc only; 0 keeps the allocator's defaults): large
            requests then reuse warm pages (:mod:`treepack.service.malloc`).
        log_level: uvicorn log level.
    """

    model_config = SettingsConfigDict(env_prefix="TREEPACK_", extra="ignore", frozen=True, env_parse_none_str="none")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    workers: int = Field(1, ge=1, le=64)
    token: Optional[SecretStr] = None
    max_body_bytes: int = Field(256 * 2**20, ge=1)
    max_sequences: int = Field(262_144, ge=1)
    max_tokens: int = Field(64 * 2**20, ge=1)
    max_concurrent_plans: int = Field(2, ge=1, le=256)
    max_queue: int = Field(8, ge=0, le=10_000)
    retry_after_s: float = Field(1.0, gt=0, le=3600)
    history_enabled: bool = True
    history_path: Optional[str] = None
    history_max_batches: int = Field(1000, ge=1)
    history_max_age_s: Optional[float] = Field(7 * 24 * 3600.0, gt=0)
    history_max_pending: int = Field(32, ge=1)
    whatif_max_trials: int = Field(2000, ge=1)
    malloc_keep_mb: int = Field(256, ge=0, le=2047)
    log_level: str = "info"
