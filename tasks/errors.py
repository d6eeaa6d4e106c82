"""The one error hierarchy: every user-facing failure is an LlmoptError with an actionable message."""

from collections.abc import Iterator


class LlmoptError(Exception):
    """Base of every error llmopt reports to a user in one line (exit code 1)."""

    exit_code = 1


class ConfigError(LlmoptError):
    """params.yaml is malformed or names an impossible value."""

    exit_code = 2


class ModelSourceError(LlmoptError):
    """The model source (params.yaml model.source) is missing, unreadable or corrupted."""


class ArtifactError(LlmoptError):
    """A variant folder or a stored artifact is missing, damaged, or not the bytes its hash records: it is
    refused, never used."""


class ArtifactUnreadable(ArtifactError):
    """A variant's weights file that its engine cannot parse, though its bytes match the recorded hash (an export
    cut short and hashed as written, a broken shipped GGUF): the run goes on without that variant."""


class BuildError(LlmoptError):
    """A technique could not build its variant (a converter or quantizer failed, a plan was not applied)."""


class EngineError(LlmoptError):
    """An inference engine cannot load or run here (its package is missing, a context does not fit)."""


class DataValidationError(LlmoptError):
    """The corpus is missing or fails its Great Expectations suite."""


class GateError(LlmoptError):
    """A promotion gate refused a model version (a verdict, not a fault: the measurements were sound)."""


class RegistryError(LlmoptError):
    """The MLflow Model Registry does not hold what was asked for."""


class TargetError(LlmoptError):
    """A step or setting the target hardware cannot run (named with the alternative)."""


class ComparisonError(LlmoptError):
    """Measurements that cannot be compared: taken on different machines or software, on different evaluation
    windows or items, or missing for the reference they are compared with."""


class ServiceError(LlmoptError):
    """A service llmopt manages (the Prefect server, …) did not start, stop or answer."""


class StorageError(LlmoptError):
    """The disk cannot hold what a stage writes (full, or over quota); nothing half-written is kept."""


def exception_chain(exc: BaseException, limit: int = 10) -> Iterator[BaseException]:
    """`exc` and the exceptions it was raised from or during (libraries wrap OS and network errors in their own)."""
    current: BaseException | None = exc
    for _ in range(limit):
        if current is None:
            return
        yield current
        current = current.__cause__ or current.__context__
