"""REST routers, one per resource, mounted under /api/v1 by `server.app.create_app`.

Routes are thin: parse and authorize (dependencies in `deps`), call one service function, shape the
response. Logic lives in `server.services`.
"""
