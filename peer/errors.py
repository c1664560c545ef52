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

    ``excluded`` names the members whose contributions were found invalid before the round failed;
    ``awaiting`` the members that may still complete the round without us, and ``awaiting_until``
    (``clock.now()``) when they must have ended it: fork choice should see how it ended."""

    def __init__(self, message: str, excluded: dict[str, str] | None = None,
                 awaiting: tuple[str, ...] = (), awaiting_until: float = 0.0):
        super().__init__(message)
        self.excluded = dict(excluded or {})
        self.awaiting, self.awaiting_until = awaiting, awaiting_until


class StateMismatch(PeerError):
    """This peer's state does not match what the group or the run attests."""
