"""Every error the gateway answers, in OpenAI's shape, and the one mapping of an error class to HTTP.

`api_error(e)` turns an exception into the `APIError` (status, message, type, param, code, headers)
the client gets: an error class of cluster/errors.py or router/errors.py by the class attributes it
carries (status, OpenAI type and code, Retry-After, Connection: close), any other as a 500 naming its
class. The gateway's own HTTP-level refusals (an unknown model, a wrong API key, a body too large or
invalid, Starlette's HTTP errors, a bug) are built by the functions below. No other module builds an
APIError (tests/router/test_errors.py checks it), so a status lives in exactly one place.
"""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.errors import PdserveError
from router.openai.protocol_responses import ErrorResponse


class APIError(Exception):
    """An HTTP error answer: raised by a route (FastAPI's handler answers it), or built and sent."""

    def __init__(self, status: int, message: str, type: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def api_error(e: BaseException) -> APIError:
    """The one mapping: what the client gets for `e`."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, PdserveError) and e.kind is not None:
        headers = {}
        if e.retry_after_s is not None:
            headers["Retry-After"] = str(e.retry_after_s)
        if e.close_connection:
            headers["Connection"] = "close"
        return APIError(e.http_status, str(e), e.openai_type, e.param, e.openai_code, headers or None)
    # An error class not meant for a client (a configuration or model-loading error): a 500 naming it.
    return APIError(500, f"internal error: {e.__class__.__name__}: {e}", "internal_error")


def _printable(s: str | None) -> str | None:
    # A message or param may quote what the client sent: a lone surrogate in it could not be encoded
    # as UTF-8 JSON (a 500 instead of the error). Escaped, it can.
    return s if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_response(e: APIError) -> JSONResponse:
    body = ErrorResponse.of(_printable(e.message), e.type, _printable(e.param), e.code).model_dump()
    return JSONResponse(body, status_code=e.status, headers=e.headers)


def error_event_data(e: BaseException) -> str:
    """The data of the SSE event that ends a stream `e` failed: OpenAI's error body, with the HTTP
    status the error would have had as its code (the response's own status is 200 by then)."""
    err = api_error(e)
    return ErrorResponse.of(_printable(err.message), err.type, _printable(err.param), err.status).model_dump_json()


# -- the gateway's own HTTP-level refusals -----------------------------------------------------------
def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def invalid_api_key() -> APIError:
    return APIError(401, "Incorrect API key provided.", "authentication_error", code="invalid_api_key")


def body_too_large(max_bytes: int) -> APIError:
    return APIError(413, f"request body is larger than {max_bytes} bytes", "invalid_request_error",
                    code="request_too_large")


def invalid_body(e: RequestValidationError) -> APIError:
    """A body that is not JSON, or does not validate against the request model (its first error)."""
    errs = e.errors()
    unknown = [".".join(str(x) for x in err.get("loc", ()) if x != "body") for err in errs
               if err.get("type") == "extra_forbidden"]
    if unknown:  # OpenAI's answer to a key it does not know, naming every one
        return APIError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", "invalid_request_error",
                        unknown[0])
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        msg, param = f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "), None
    else:
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        param = loc[0] if loc else None
    return APIError(400, msg, "invalid_request_error", param)


def http_error(e: StarletteHTTPException) -> APIError:
    """Starlette's own (an unknown path, a wrong method)."""
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return APIError(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None))


def unexpected_error(e: BaseException) -> APIError:
    """A bug: a 500 with an OpenAI body that names the exception's class, not its text."""
    return APIError(500, f"internal error: {e.__class__.__name__}", "internal_error")
