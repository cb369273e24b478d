"""The front door's own counters, in Prometheus' text format; `/metrics` serves them followed by
tritonserver's (the engine's `minisgl_*` metrics), so that one scrape has both."""

from __future__ import annotations

import urllib.request
from collections import Counter
from dataclasses import dataclass, field

PREFIX = "minisgl_openai_"


@dataclass
class FrontDoorMetrics:
    """Requests by endpoint and outcome (`ok`, `bad_request`, `unauthorized`, `error`,
    `cancelled`: the client left first), those in flight, and the tokens they used."""

    requests: Counter = field(default_factory=Counter)  # (endpoint, outcome) -> count
    running: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def ended(self, endpoint: str, outcome: str, prompt_tokens: int = 0,
              completion_tokens: int = 0) -> None:
        self.requests[endpoint, outcome] += 1
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def text(self) -> str:
        lines = [f"# HELP {PREFIX}requests_total Requests of the OpenAI-compatible API, by "
                 "endpoint and outcome", f"# TYPE {PREFIX}requests_total counter"]
        lines += [f'{PREFIX}requests_total{{endpoint="{endpoint}",outcome="{outcome}"}} {count}'
                  for (endpoint, outcome), count in sorted(self.requests.items())]
        for name, kind, value, doc in (
                ("requests_running", "gauge", self.running, "Requests being answered"),
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens"),
                ("completion_tokens_total", "counter", self.completion_tokens,
                 "Tokens generated")):
            lines += [f"# HELP {PREFIX}{name} {doc}", f"# TYPE {PREFIX}{name} {kind}",
                      f"{PREFIX}{name} {value}"]
        return "\n".join(lines) + "\n"


def server_metrics(url: str | None) -> str:
    """tritonserver's metrics text ('' when there is no URL or it does not answer)."""
    if not url:
        return ""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""
