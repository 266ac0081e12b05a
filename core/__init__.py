"""Pure-Python domain of ftune: settings, the job spec, states, storage, data and planning.

Nothing here imports torch, fastapi, celery or sqlalchemy, so it is fast to import everywhere.
"""
