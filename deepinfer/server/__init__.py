"""OpenAI-compatible HTTP server (``deepinfer serve``): FastAPI routes over an engine thread.

    from deepinfer.server import build_app
    app = build_app(LLMEngine.from_engine_args(device="cpu"), api_key="sk-local")

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from deepinfer.server.app import DEMO_MODEL_NAME, ServerState, build_app, default_model_name
from deepinfer.server.async_engine import AsyncEngine, EngineClosed, RequestStream

__all__ = ["DEMO_MODEL_NAME", "AsyncEngine", "EngineClosed", "RequestStream", "ServerState", "build_app",
           "default_model_name"]
