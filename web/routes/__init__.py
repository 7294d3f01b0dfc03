"""The dashboard's routers, one per page family."""
