"""Errors that name what is wrong. The server maps them to OpenAI-style error JSON."""


class ServescopeError(Exception):
    """Base class of every error servescope raises on purpose."""


class InvalidParameterError(ServescopeError, ValueError):
    """A user-supplied value is out of range. `param` names the field (OpenAI's `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param
        self.message = message


class ModelLoadError(ServescopeError):
    """A model could not be loaded: missing, truncated or corrupt file, unsupported architecture."""


class EngineConfigError(ServescopeError, ValueError):
    """An engine setting that makes no sense (zero blocks, a token budget below one block, ...)."""


class WorkerFailedError(ServescopeError):
    """A tensor/pipeline-parallel worker died or stopped answering: the engine cannot run a step
    (the server answers 503; restart the engine)."""
