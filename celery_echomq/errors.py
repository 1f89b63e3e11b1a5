"""Every error celery-echomq raises derives from :class:`EchoMQError`.

Input errors are also ``ValueError`` so callers that already guard a canvas with
``except ValueError`` keep working.
"""

from __future__ import annotations


class EchoMQError(Exception):
    """Base of every celery-echomq error."""


class ConfigError(EchoMQError):
    """The app's ``echomq_*`` settings cannot be used (e.g. no Redis URL)."""


class InvalidIdError(EchoMQError, ValueError):
    """A job id or queue name cannot be made into a key (empty, too long, braces, colon, space)."""


class KindError(InvalidIdError):
    """A job id is not ``JOB``-namespaced; also what the scripts' ``EMQKIND`` reply becomes."""


class DuplicateIdError(InvalidIdError):
    """The same job id appears twice inside one flow."""


class FlowExistsError(EchoMQError, ValueError):
    """A job id of the flow already exists in Redis; nothing was written or published."""


class PolicyError(EchoMQError, ValueError):
    """An unknown ``parent_policy`` name."""


class StoreUnavailableError(EchoMQError):
    """Redis could not be reached while starting a flow; nothing was published."""


class FlowFailed(EchoMQError):
    """A child failed under policy ``fail``: the parent will never run.

    ``child_id`` names the failed child; ``error`` is its ``"ExcType: message"``.
    """

    def __init__(self, message: str = "", child_id: str = "", error: str = "") -> None:
        super().__init__(message, child_id, error)
        self.child_id = child_id
        self.error = error

    def __str__(self) -> str:
        return str(self.args[0])


class FlowCancelled(EchoMQError):
    """The flow was cancelled with ``FlowResult.revoke()``; the parent will never run."""

    def __init__(self, message: str = "", flow_id: str = "") -> None:
        super().__init__(message, flow_id)
        self.flow_id = flow_id

    def __str__(self) -> str:
        return str(self.args[0])
