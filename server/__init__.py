"""The LoCoJAX control plane: settings, database, ORM models, schemas, services and the REST API.

Entry points: `server.app.create_app(settings)` (ASGI app), `server.cli.register` (`locojax serve`,
`locojax token ...`, `locojax db upgrade`). Depends on the engine only through `locojax.spec`, the model
catalog, the task/reward registries and the placement library.
"""
