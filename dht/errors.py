"""Errors of the DHT layer. Every one of them can be caused by a user or a remote peer."""

from __future__ import annotations


class DHTError(Exception):
    """Base of the DHT layer's errors; the CLI prints it as one line."""


class BootstrapError(DHTError):
    """The initial peers are malformed or none of them could be reached."""


class AddressError(BootstrapError):
    """A multiaddr given by the user is malformed (a usage error, not a network failure)."""


class ListenError(AddressError):
    """A listen address given by the user cannot be used: its port is in use, or needs privileges."""


class InvalidRecord(DHTError):
    """A record is malformed, oversized, expired too far ahead, or its signature does not verify."""


class DHTTimeout(DHTError):
    """A DHT call did not finish within its deadline."""


class RunNotFound(DHTError):
    """No valid run spec is published under the given run key."""
