"""Database tables (SQLAlchemy 2.0 ORM) and the queries on them. "model" here never means an ML model."""

from models.tables import Artifact, Base, Dataset, Job, JobEvent, Worker

__all__ = ["Artifact", "Base", "Dataset", "Job", "JobEvent", "Worker"]
