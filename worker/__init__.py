"""Celery workers on hosts (DESIGN §7): host registration, heartbeats, starting engine host processes. Not built yet (issue 8)."""
