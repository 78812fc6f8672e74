"""Errors a user can cause. Each carries a message that names the input and the limit.

The CLI turns them into a one-line message and exit status 2; the server turns them into
OpenAI-style error JSON with the attached HTTP status.
"""


class ServelabError(Exception):
    """Base class for every error a user can cause."""

    http_status = 400
    error_type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidArgument(ServelabError):
    """A bad value: unknown model, negative rate, malformed list, ..."""


class NotFound(ServelabError):
    http_status = 404
    error_type = "not_found_error"


class RequestTooLong(ServelabError):
    """Prompt (+ max tokens) exceeds max_model_len, or the prompt can never fit the KV pool."""

    code = "context_length_exceeded"


class Unsupported(ServelabError):
    """A route or feature this deployment does not provide (e.g. embeddings behind a cluster)."""

    http_status = 501
    error_type = "not_implemented_error"


class QueueFull(ServelabError):
    """The bounded waiting queue is full: the client should retry later."""

    http_status = 503
    error_type = "server_overloaded"


class CompilerUnavailable(ServelabError):
    """The grammar compiler's worker process could not start: the client may retry."""

    http_status = 503
    error_type = "server_overloaded"


class DoesNotFit(ServelabError):
    """A configuration whose weights or KV cache do not fit in device memory."""
