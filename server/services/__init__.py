"""Control-plane logic. Routers, CLI commands and Celery tasks call these; none of them holds logic of its own.

Each function takes a SQLAlchemy `Session` and owns its unit of work (it commits), so a failure
anywhere before the commit writes nothing.
"""
