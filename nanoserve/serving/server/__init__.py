"""An OpenAI-compatible HTTP server over the engine (needs the `serve` extra: fastapi, uvicorn)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanoserve.config import EngineConfig


def serve(model: str | Path | None = None, host: str = "127.0.0.1", port: int = 8000,
          config: EngineConfig | None = None, served_model_name: str | None = None,
          log_level: str = "info") -> None:
    """Loads the model and serves it until interrupted. Binds loopback unless `host` says otherwise."""
    import uvicorn

    from nanoserve.engine import Engine
    from nanoserve.model.default import MODEL_NAME
    from nanoserve.serving.server.app import create_app

    path = Path(model) if model is not None else None  # None: the default model's GGUF, served as stored
    engine = Engine.from_pretrained(path, config)
    name = MODEL_NAME if path is None else path.stem if path.suffix == ".gguf" else path.name
    app = create_app(engine, served_model_name or name)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


__all__ = ["serve"]
