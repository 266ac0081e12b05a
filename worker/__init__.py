"""Celery worker: thin tasks that claim a job and supervise its training subprocess."""
