"""The OpenAI-compatible HTTP server: FastAPI app, protocol models, metrics, playground page.

``create_app(engine, ServerConfig(...))`` builds the app; ``BackgroundServer`` runs it under uvicorn in
a thread (tests, notebooks, benchmarks); ``scratchlm serve`` is the command line.
"""

from scratchlm.server.app import create_app
from scratchlm.server.background import BackgroundServer
from scratchlm.server.config import ServerConfig

__all__ = ["BackgroundServer", "ServerConfig", "create_app"]
