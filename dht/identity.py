"""Ed25519 identities and self-certifying run keys.

A run key is ``<name>.<fingerprint>`` where the fingerprint is derived from the run owner's public
key, so anyone holding the key can check that a run spec was signed by its owner without trusting
the peer that served it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import InvalidRecord

PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64
FINGERPRINT_LEN = 32  # base32 characters (160 bits)
_RUN_NAME = r"[a-z0-9][a-z0-9_-]{0,47}"
RUN_KEY_RE = re.compile(rf"^({_RUN_NAME})\.([a-z2-7]{{{FINGERPRINT_LEN}}})$")


def fingerprint(public_key: bytes) -> str:
    """Stable, lowercase base32 fingerprint of a raw Ed25519 public key (160 bits of SHA-256)."""
    digest = hashlib.sha256(b"hivetrain-key-v1\0" + public_key).digest()[:20]
    return base64.b32encode(digest).decode("ascii").lower()


def make_run_key(name: str, owner_public_key: bytes) -> str:
    return f"{name}.{fingerprint(owner_public_key)}"


def parse_run_key(run_key: str) -> tuple[str, str]:
    """Returns (name, fingerprint); raises ValueError with a user-facing message if malformed."""
    match = RUN_KEY_RE.fullmatch(run_key) if isinstance(run_key, str) else None
    if match is None:
        raise ValueError(
            f"run key {run_key!r} is malformed: expected <name>.<{FINGERPRINT_LEN} base32 characters>, "
            "as printed by 'peer start --new-run'"
        )
    return match.group(1), match.group(2)


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raises InvalidRecord unless ``signature`` is a valid Ed25519 signature of ``message``."""
    if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
        raise InvalidRecord("bad public key or signature length")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise InvalidRecord("signature does not verify") from None


class Identity:
    """An Ed25519 key pair; signs records. Optionally persisted to a file (mode 0600)."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.fingerprint: str = fingerprint(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load_or_create(cls, path: str) -> Identity:
        """Loads the key at ``path``, or creates it there atomically with mode 0600."""
        if os.path.exists(path):
            with open(path, "rb") as f:
                raw = f.read(4096)
            try:
                key = serialization.load_pem_private_key(raw, password=None)
            except ValueError:
                raise ValueError(f"identity file {path} is not a PEM private key") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise ValueError(f"identity file {path} does not hold an Ed25519 key")
            return cls(key)
        identity = cls.generate()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(identity._key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ))
        os.replace(tmp, path)
        return identity

    def sign(self, message: bytes) -> bytes:
        return self._key.sign(message)
