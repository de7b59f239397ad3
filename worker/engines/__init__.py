"""Engines: one per worker process, shared by all of its Celery task threads."""

from __future__ import annotations

import os

from tasks.config import Settings
from worker.engines.base import Engine, GenerationError, Sink


def create_engine(settings: Settings, sink: Sink | None = None) -> Engine:
    """Build and load the engine the settings name. Imports heavy libraries only here."""
    if settings.engine == "echo":
        from worker.engines.echo import EchoEngine

        return EchoEngine(settings, sink)
    if settings.engine == "sim":
        from worker.engines.sim import SimEngine

        return SimEngine(settings, sink)
    if settings.engine == "embed" or (settings.engine == "hf" and is_embedding_model(settings.model)):
        from worker.engines.embed import EmbedEngine

        return EmbedEngine(settings)
    if settings.engine == "hf":
        from worker.engines.hf import HFEngine

        return HFEngine(settings, sink)
    if settings.engine == "llamacpp":
        from worker.engines.llamacpp import LlamaCppEngine

        return LlamaCppEngine(settings, sink)
    if settings.engine == "vllm":
        from worker.engines.vllm import VLLMEngine

        return VLLMEngine(settings, sink)
    raise ValueError(f"unknown engine {settings.engine!r}")


def is_embedding_model(model: str) -> bool:
    """Whether `model` is a sentence-transformers folder (its modules.json lists the modules,
    pooling and normalization included, that make a text's embedding)."""
    return os.path.isfile(os.path.join(model, "modules.json"))


__all__ = ["Engine", "GenerationError", "Sink", "create_engine"]
