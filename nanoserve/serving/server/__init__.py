"""An OpenAI-compatible HTTP server over the engine (needs the `serve` extra: fastapi, uvicorn)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig
    from nanoserve.engine import Engine
    from nanoserve.serving.server.guard import ServerConfig


def serve(model: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000,
          config: EngineConfig | None = None, served_model_name: str | None = None,
          log_level: str = "info", server_config: ServerConfig | None = None, engine: Engine | None = None) -> None:
    """Loads the model (or takes `engine`, built from it) and serves it until SIGTERM or SIGINT
    drains it (see guard.DrainingServer). Binds loopback unless `host` says otherwise."""
    import uvicorn

    from nanoserve.engine import Engine
    from nanoserve.model.default import MODEL_NAME
    from nanoserve.serving.server.app import create_app
    from nanoserve.serving.server.guard import DrainingServer, ServerConfig, run_until_drained

    path = Path(model) if model is not None else None  # None: the default model's GGUF, served as stored
    name = MODEL_NAME if path is None else path.stem if path.suffix == ".gguf" else path.name
    server_config = server_config or ServerConfig()
    with engine or Engine.from_pretrained(path, config) as engine:  # a tensor-parallel engine's workers end with it
        app = create_app(engine, served_model_name or name, server_config)
        uvicorn_config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                        timeout_graceful_shutdown=server_config.drain_timeout_s)
        run_until_drained(DrainingServer(uvicorn_config, app.state.async_engine))


__all__ = ["serve"]
