"""Ed25519 identities, libp2p peer ids and self-certifying run keys.

A peer's identity is one Ed25519 key: the p2p daemon runs with it (so the libp2p peer id that the
transport authenticates is derived from it) and it signs the peer's records and statements. An
Ed25519 peer id embeds its public key, so a signature is checked against the peer id alone
(``verify_peer``): nothing can be said in another peer's name.

A run key is ``<name>.<fingerprint>`` where the fingerprint is derived from the run owner's public
key, so anyone holding the key can check that a run spec was signed by its owner without trusting
the peer that served it.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import os
import re

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .errors import InvalidRecord

PUBLIC_KEY_LEN = 32
SIGNATURE_LEN = 64
FINGERPRINT_LEN = 32  # base32 characters (160 bits)
_RUN_NAME = r"[a-z0-9][a-z0-9_-]{0,47}"
RUN_KEY_RE = re.compile(rf"^({_RUN_NAME})\.([a-z2-7]{{{FINGERPRINT_LEN}}})$")
# libp2p's protobuf PublicKey {key_type: Ed25519 (1), data: 32 bytes}, wrapped in an identity multihash
# (code 0x00, length 36): the peer id *is* the public key, no hash to invert.
_PEER_ID_PREFIX = bytes([0x00, 0x24, 0x08, 0x01, 0x12, 0x20])
_P2P_PRIVATE_PREFIX = bytes([0x08, 0x01, 0x12, 0x40])  # protobuf PrivateKey {Ed25519, 64 bytes}
MAX_PEER_ID_LEN = 128
PEER_ID_RE = re.compile(rf"^[1-9A-HJ-NP-Za-km-z]{{20,{MAX_PEER_ID_LEN}}}$")  # base58, any key type (what the wire accepts)


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


@functools.lru_cache(maxsize=16384)  # every read of a record key re-derives it: base58 is slow in Python
def peer_id_of(public_key: bytes) -> str:
    """The base58 libp2p peer id of a raw Ed25519 public key (what p2pd prints as 12D3KooW...)."""
    if len(public_key) != PUBLIC_KEY_LEN:
        raise InvalidRecord("bad public key length")
    return base58.b58encode(_PEER_ID_PREFIX + public_key).decode("ascii")


def public_key_of(peer_id: str) -> bytes:
    """The Ed25519 public key inside a base58 libp2p peer id; raises InvalidRecord for any other
    kind of id (RSA ids hash their key: such a peer cannot sign records that we accept)."""
    if not isinstance(peer_id, str) or not PEER_ID_RE.fullmatch(peer_id):
        raise InvalidRecord("not a base58 peer id")
    raw = base58.b58decode(peer_id)
    if len(raw) != len(_PEER_ID_PREFIX) + PUBLIC_KEY_LEN or not raw.startswith(_PEER_ID_PREFIX):
        raise InvalidRecord("peer id does not embed an Ed25519 public key")
    return raw[len(_PEER_ID_PREFIX):]


def verify_peer(peer_id: str, signature: bytes, message: bytes) -> None:
    """Raises InvalidRecord unless ``signature`` over ``message`` is by the key of ``peer_id``."""
    verify(public_key_of(peer_id), signature, message)


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raises InvalidRecord unless ``signature`` is a valid Ed25519 signature of ``message``."""
    if len(public_key) != PUBLIC_KEY_LEN or len(signature) != SIGNATURE_LEN:
        raise InvalidRecord("bad public key or signature length")
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError):
        raise InvalidRecord("signature does not verify") from None


class Identity:
    """An Ed25519 key pair: the peer's libp2p identity and the signer of its records and statements.
    Optionally persisted to a file (PEM, mode 0600)."""

    def __init__(self, private_key: Ed25519PrivateKey):
        self._key = private_key
        self.public_key: bytes = private_key.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.fingerprint: str = fingerprint(self.public_key)
        self.peer_id: str = peer_id_of(self.public_key)

    def p2p_private_key(self) -> bytes:
        """The key in libp2p's protobuf encoding, as the p2p daemon reads it (``-id`` file)."""
        seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                       serialization.NoEncryption())
        return _P2P_PRIVATE_PREFIX + seed + self.public_key

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
