"""The errors of KV transfer: why a connect, grant check or write did not succeed.

Refusals say the request itself cannot be served (GrantRefused; BackendMismatch and
libkv.layout.LayoutMismatch in connect); every other TransferError is a failure of the transfer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from libkv.transfer.grants import Refusal


class TransferError(RuntimeError):
    """A transfer did not complete; subclasses say why."""


class PeerUnreachable(TransferError):
    """The peer refused, dropped or never answered the connection or a write."""


class TransferTimeout(TransferError):
    """A write took longer than the backend's timeout_s; its peer is declared dead."""


class TransferAborted(TransferError):
    """The transfer was aborted by abort() (or the backend was closed under it)."""


class GrantRefused(TransferError):
    """The receiver did not reserve these pages for this room and grant (verify_grant, or a
    two-sided receiver refusing a write). Nothing was written; the message names the first
    refused page and how many were refused."""

    def __init__(self, message: str, refusal: Refusal) -> None:
        super().__init__(message)
        self.refusal = refusal


class BackendMismatch(ValueError):
    """Two workers use different transfer backends (or TP sizes this backend cannot map); the
    message names both values."""


class EngineUnavailable(ImportError):
    """The transfer engine's Python package (or a system library it needs) is not installed."""
