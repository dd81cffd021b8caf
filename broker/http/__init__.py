"""The broker's HTTP API: routes, middlewares, auth, OpenAPI."""
