"""Keyset pagination over (created_at, id), newest first, with an opaque cursor."""

from __future__ import annotations

import base64
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Select, and_, or_

from core.errors import InvalidInput
from core.spec import ID_RE


def encode_cursor(created_at: datetime, id_: str) -> str:
    return base64.urlsafe_b64encode(f"{created_at.isoformat()}|{id_}".encode()).decode()


def decode_cursor(cursor: str) -> tuple[datetime, str]:
    try:
        stamp, id_ = base64.urlsafe_b64decode(cursor.encode()).decode().split("|", 1)
        created_at = datetime.fromisoformat(stamp)
        if created_at.tzinfo is None:  # the database layer refuses naive times with an error
            raise ValueError("naive timestamp")
        created_at = created_at.astimezone(UTC)
    except (ValueError, UnicodeDecodeError, OverflowError) as e:
        raise InvalidInput("invalid pagination cursor", code="invalid_cursor", param="after") from e
    if not ID_RE.match(id_):  # only ids go to the database (PostgreSQL refuses NUL bytes with an error)
        raise InvalidInput("invalid pagination cursor", code="invalid_cursor", param="after")
    return created_at, id_


def newest_first(stmt: Select[Any], table: Any, after: str | None, limit: int) -> Select[Any]:
    if after:
        created_at, id_ = decode_cursor(after)
        stmt = stmt.where(
            or_(table.created_at < created_at, and_(table.created_at == created_at, table.id < id_))
        )
    return stmt.order_by(table.created_at.desc(), table.id.desc()).limit(limit + 1)


def page(rows: list[Any], limit: int) -> tuple[list[Any], str | None]:
    """Split the limit+1 rows fetched into a page and the cursor of the next page (None at the end)."""
    if len(rows) <= limit:
        return rows, None
    last = rows[limit - 1]
    return rows[:limit], encode_cursor(last.created_at, last.id)
