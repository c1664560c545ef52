"""The exception family of the client. ``raise`` these for what a user or a peer can cause."""

from __future__ import annotations


class PeerError(Exception):
    """Base of every error a user or a remote peer can cause; the CLI prints it as one line."""


class ConfigError(PeerError, ValueError):
    """A configuration value (CLI flag, run spec field) is out of range or malformed."""


class DataError(PeerError):
    """The training corpus cannot be read or is unusable."""


class RoundFailed(PeerError):
    """An outer round could not complete for this peer; the round is void and nothing was applied.

    ``excluded`` names the members whose contributions were found invalid before the round failed."""

    def __init__(self, message: str, excluded: dict[str, str] | None = None):
        super().__init__(message)
        self.excluded = dict(excluded or {})


class StateMismatch(PeerError):
    """This peer's state does not match what the group or the run attests."""
