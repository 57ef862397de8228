"""Where the API key comes from: `api_key` (a flag or YAML key: visible in `ps` as a flag),
`api_key_file` (its first line), or the PDSERVE_API_KEY environment variable. They are one setting:
a later source (defaults < YAML < environment < flags) replaces an earlier one, and giving two in the
same source is an error. And the warning for an API anyone can reach without a key."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deploy.bind_address import is_loopback


def apply_key_sources(data: dict[str, Any], overrides: dict[str, Any], env) -> None:
    """Before the flags (`overrides`) are applied over the YAML's `data`: the key's later source wins."""
    if any(overrides.get(k) is not None for k in ("api_key", "api_key_file")):
        data.pop("api_key", None), data.pop("api_key_file", None)
    elif env.get("PDSERVE_API_KEY"):
        data.pop("api_key_file", None)
        data["api_key"] = env["PDSERVE_API_KEY"]


def read_key_file(data: Any) -> Any:
    """The config's fields with `api_key` read from `api_key_file` (a ValueError naming the problem)."""
    path = data.get("api_key_file") if isinstance(data, dict) else None
    if path is None:
        return data
    if data.get("api_key") is not None:
        raise ValueError("give the API key once: api_key or api_key_file (or PDSERVE_API_KEY)")
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"api_key_file {path}: {e.strerror}") from None
    return {**data, "api_key": lines[0].strip() if lines else ""}


def open_api_warnings(host: str, api_key: str | None) -> list[str]:
    """What the launcher warns about at start (served anyway: a trusted network may want it)."""
    if is_loopback(host) or api_key is not None:
        return []
    return [f"the HTTP API listens on {host} (not only this machine) without an API key: anyone who reaches "
            "the port can use it; set --api-key-file or PDSERVE_API_KEY"]
