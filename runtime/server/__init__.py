"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the AsyncEngine.

Nothing is imported here, so `envex.runtime.server.generate_cli` works without the web stack. Entry points:
`envex.runtime.server.app.build_app`, `envex.runtime.server.serve.serve`, `envex.runtime.server.generate_cli`.
"""
