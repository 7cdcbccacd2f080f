"""OpenAI-compatible HTTP server (``selfspec serve``): see docs/SERVER.md.

app.py (create_app, make_server, the CLI command), routes.py (endpoints), worker.py (FIFO queue and
the thread that owns the engine), schemas.py (pydantic bodies), errors.py (OpenAI error objects),
middleware.py (API key, HTTP metrics), metrics.py (Prometheus, prometheus_client), config.py (ServeConfig).
"""
