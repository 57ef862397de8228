"""The router's own error classes: admission's refusals, the drain, an unreachable router, a failed
generation. Each says how it reaches a client in its class attributes (see cluster/errors.py, which
holds the core ones and the `ERROR_KINDS` registry these join by setting `kind`); the gateway maps
all of them through router/openai/errors.py::api_error and the channel carries them by kind.

    InvalidRequestError (cluster)    400 invalid_request_error
    CapacityError (cluster)          429 rate_limit_error, Retry-After 1
      OverloadedError                429 rate_limit_error, Retry-After: its retry_after_s
        CapacityShortError           (as OverloadedError: decided on polled state, re-asked first)
          NotPlacedError             (admitted, then refused by every worker: queued again first)
    NoHealthyWorkerError             503 service_unavailable, no_healthy_worker
      DrainingError                  503 service_unavailable, draining, Retry-After 1, Connection: close
      RouterUnavailableError         503 service_unavailable, no_healthy_worker
    GenerationError                  500 internal_error (or an error event in the stream)
"""

from __future__ import annotations

from cluster.errors import CapacityError, PdserveError


class OverloadedError(CapacityError):
    """HTTP 429: try again later (after `retry_after_s`)."""

    kind = "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class CapacityShortError(OverloadedError):
    """HTTP 429 decided on the workers' polled state (KV room, prefill queues): a fresh poll may
    change the answer, so the router re-polls and asks again before it lets this out (it reaches the
    gateway as an OverloadedError)."""


class NotPlacedError(CapacityShortError):
    """HTTP 429 unless re-queued: no decode worker took an admitted request within reserve_wait_s,
    although admission had seen room (a view a poll behind the worker: a worker refuses what does not
    fit). Router.submit puts the request back in the admission queue until queue_timeout_s."""


class NoHealthyWorkerError(PdserveError):
    """HTTP 503: no worker can serve the request at all."""

    kind = "no_worker"
    http_status = 503
    openai_type = "service_unavailable"
    openai_code = "no_healthy_worker"


class DrainingError(NoHealthyWorkerError):
    """HTTP 503: the server is shutting down (SIGTERM); the client retries on another replica."""

    kind = "draining"
    openai_code = "draining"
    retry_after_s = 1
    close_connection = True

    def __init__(self, message: str = "the server is shutting down; retry on another replica"):
        super().__init__(message)


class RouterUnavailableError(NoHealthyWorkerError):
    """HTTP 503: the router did not answer in time (raised by the gateway's end of the channel)."""

    kind = "router_unavailable"


class GenerationError(PdserveError):
    """A worker failed the request after it was admitted (HTTP 500 / an error event in the stream)."""

    kind = "generation"
