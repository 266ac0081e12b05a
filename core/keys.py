"""API keys: `ftk_<id>_<secret>`. Only a sha256 of the secret is stored; the id finds the row.

The secret has 192 bits of entropy, so a fast hash is enough (no password-style stretching needed),
and comparison is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_RE = re.compile(r"^ftk_([a-z0-9]{12})_([A-Za-z0-9_-]{32})$")


def new_key() -> tuple[str, str, str]:
    """Returns (key to show once, key id, secret hash to store)."""
    key_id = secrets.token_hex(6)
    secret = secrets.token_urlsafe(24)
    return f"ftk_{key_id}_{secret}", key_id, hash_secret(secret)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse(key: str) -> tuple[str, str] | None:
    m = KEY_RE.match(key)
    return (m.group(1), m.group(2)) if m else None


def matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)
