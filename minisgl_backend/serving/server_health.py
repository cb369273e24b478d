"""Is tritonserver stopping? Asked over its own HTTP endpoint, never through the stub.

On SIGTERM tritonserver stops counting decoupled requests as in flight and waits for them
only until its exit timeout; the engine model must notice and end its streams itself.
`pb_utils.is_model_ready` answers that, but in Triton 2.51 the stub sometimes crashes with
SIGSEGV inside it once the server has begun to stop (seen in about one shutdown in three,
on any thread), and a crashed stub leaves its streams without a final response. The server's
HTTP endpoint answers the same question from outside the stub (not ready, or no longer
listening: a stopping server closes its endpoints); its address and port are on the server's
command line (tritonserver is the stub's parent process).
"""

from __future__ import annotations

import enum
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_HTTP_PORT = 8000
_FALSE = ("false", "0", "off", "no")
# The server is on this host: never through an HTTP proxy from the environment.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_options(server_pid: int) -> dict[str, str]:
    """`--name=value` and `--name value` options of a process's command line, by name."""
    try:
        args = [a.decode() for a in Path(f"/proc/{server_pid}/cmdline").read_bytes()
                .split(b"\0") if a]
    except (OSError, UnicodeDecodeError):
        return {}
    options: dict[str, str] = {}
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:
            following = args[i + 1] if i + 1 < len(args) else ""
            value = "" if following.startswith("--") else following
        options[name] = value
    return options


def model_ready_url(server_pid: int, model_name: str) -> str | None:
    """`/v2/models/<name>/ready` on the server's HTTP endpoint (loopback for a wildcard
    address); None when HTTP is off."""
    options = server_options(server_pid)
    if options.get("allow-http", "true").lower() in _FALSE:
        return None
    port = options.get("http-port") or str(DEFAULT_HTTP_PORT)
    host = options.get("http-address") or "0.0.0.0"
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{port}/v2/models/{urllib.parse.quote(model_name)}/ready"


# Triton answers 400 for a model that is not ready (the server stopping unloads it); 503 is an
# unavailable server. Other statuses (401/403 of a restricted or authenticated endpoint, 404 of
# a wrong guess of the URL) say nothing about the model.
NOT_READY_STATUSES = (400, 503)


class Readiness(enum.Enum):
    READY = "ready"  # 200
    NOT_READY = "not ready"  # 400 / 503: not ready, or the server is stopping
    REFUSED = "refused"  # nothing listens: a stopping tritonserver closes its endpoints early
    NO_ANSWER = "no answer"  # a timeout under load, another status: no evidence either way


def model_ready(url: str, timeout: float = 2.0) -> Readiness:
    """What the readiness endpoint at `url` says."""
    try:
        with _NO_PROXY.open(url, timeout=timeout) as response:
            return Readiness.READY if response.status == 200 else Readiness.NO_ANSWER
    except urllib.error.HTTPError as exc:
        return Readiness.NOT_READY if exc.code in NOT_READY_STATUSES else Readiness.NO_ANSWER
    except urllib.error.URLError as exc:
        refused = isinstance(exc.reason, ConnectionRefusedError)
        return Readiness.REFUSED if refused else Readiness.NO_ANSWER
    except ConnectionRefusedError:
        return Readiness.REFUSED
    except OSError:
        return Readiness.NO_ANSWER
