"""webhooks.previous_secret and previous_secret_expires_at: a rotated secret that still signs for a grace
period; webhooks.deleted_at: a deleted endpoint (its row and deliveries stay, its secrets are cleared).

Secrets are sealed by the application from now on (core.secretbox, `enc1:...`, 85 characters: the column
keeps its size). Rows written before hold a plain `whsec_...`, read as such until the secret is rotated: the
key that seals lives outside the database, so this migration cannot seal them.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 10:00:00.000000
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Added columns only: SQLite adds them in place (no copy of a table that other tables reference).
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        batch_op.add_column(sa.Column("previous_secret", sa.String(length=100), nullable=True))
        batch_op.add_column(
            sa.Column("previous_secret_expires_at", sa.DateTime(timezone=True), nullable=True)
        )
        batch_op.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("webhooks", schema=None) as batch_op:
        batch_op.drop_column("deleted_at")
        batch_op.drop_column("previous_secret_expires_at")
        batch_op.drop_column("previous_secret")
