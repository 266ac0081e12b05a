"""Secrets encrypted at rest (webhook signing secrets) with a key kept outside the database.

The key comes from FTUNE_SECRET_KEY (any long random string), else from `secret.key` in the data directory,
made (0600, 256 random bits) on first use. Every process that reads the secrets needs the same key: a worker
on another machine than the API sets FTUNE_SECRET_KEY to the file's content.

A sealed value is `enc1:` + base64url(nonce | AES-256-GCM ciphertext and tag) with the row's id as associated
data, so a sealed value copied onto another row does not open. AES-GCM (rather than Fernet) keeps a sealed
32-byte secret at 85 characters, within the column it always had.
"""

from __future__ import annotations

import base64
import functools
import os
import secrets
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from core.settings import Settings

PREFIX = "enc1:"
KEY_FILE = "secret.key"
_NONCE = 12


class SecretUnreadable(ValueError):
    """A sealed value that this key does not open (another key, or tampered with)."""


class SecretBox:
    def __init__(self, material: bytes) -> None:
        if len(material) < 16:
            raise ValueError("the secret key must have at least 16 bytes")
        hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"ftune secrets at rest v1")
        self._aead = AESGCM(hkdf.derive(material))

    @classmethod
    def from_settings(cls, settings: Settings) -> SecretBox:
        return _box(settings.secret_key.get_secret_value(), settings.data_dir / KEY_FILE)

    def seal(self, data: bytes, *, context: str) -> str:
        nonce = os.urandom(_NONCE)
        sealed = nonce + self._aead.encrypt(nonce, data, context.encode())
        return PREFIX + base64.urlsafe_b64encode(sealed).decode().rstrip("=")

    def open(self, value: str, *, context: str) -> bytes:
        if not is_sealed(value):
            raise SecretUnreadable("not a sealed value")
        raw = base64.urlsafe_b64decode(value.removeprefix(PREFIX) + "=" * (-len(value) % 4))
        try:
            return self._aead.decrypt(raw[:_NONCE], raw[_NONCE:], context.encode())
        except InvalidTag as e:
            raise SecretUnreadable(
                "the secret key does not open this value (is FTUNE_SECRET_KEY the same?)"
            ) from e


def is_sealed(value: str) -> bool:
    return value.startswith(PREFIX)


def key_material(key_file: Path) -> bytes:
    """The content of `key_file`, made 0600 with 256 random bits when there is none: written whole under
    another name, then linked into place, so a process racing to make it reads the one that won, whole."""
    if not key_file.exists():
        tmp = key_file.with_name(f".{key_file.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, key_file)
        except FileExistsError:
            pass  # another process made it first: theirs is the key
        finally:
            tmp.unlink(missing_ok=True)
    return key_file.read_bytes().strip()


@functools.cache
def _box(secret_key: str, key_file: Path) -> SecretBox:
    if secret_key:
        return SecretBox(secret_key.encode())
    key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    return SecretBox(key_material(key_file))
