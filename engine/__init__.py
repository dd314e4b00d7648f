"""nanoqwen.engine: everything model-side. What the app and the CLI use is the engine service
(engine/service.py), re-exported here; importing this package loads no torch (the loader and
the backends are imported when a model is opened)."""

from .service import (BACKENDS, BATCH_SECONDS, MODES, Batch, EngineService, Failed, Finished,
                      LoadedModel, Note, SeenMeter, ServiceEvent, StatsUpdate,
                      default_model_path, describe_error)

__all__ = ["BACKENDS", "BATCH_SECONDS", "MODES", "Batch", "EngineService", "Failed", "Finished",
           "LoadedModel", "Note", "SeenMeter", "ServiceEvent", "StatsUpdate",
           "default_model_path", "describe_error"]
