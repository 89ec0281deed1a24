"""OpenAI-compatible HTTP server (``deepinfer serve``): FastAPI routes over an engine process (or thread).

    from deepinfer.server import EngineClient, build_app
    app = build_app(EngineClient.launch(EngineConfig.create(EngineArgs(device="cpu"))), api_key="sk-local")
    app = build_app(LLMEngine.from_engine_args(device="cpu"), api_key="sk-local")  # the engine in a thread

Needs the ``serve`` extra (fastapi, uvicorn, prometheus-client).
"""

from deepinfer.server.app import DEMO_MODEL_NAME, ServerState, build_app, default_model_name
from deepinfer.server.async_engine import AsyncEngine, EngineClosed, RequestStream
from deepinfer.server.engine_client import EngineClient

__all__ = ["DEMO_MODEL_NAME", "AsyncEngine", "EngineClient", "EngineClosed", "RequestStream", "ServerState",
           "build_app", "default_model_name"]
