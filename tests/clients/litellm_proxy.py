"""The `litellm` command (LiteLLM's proxy CLI, `litellm.proxy.proxy_cli:run_server`), with the
HTTP requests it makes appended as JSON lines to $CLIENT_RECORD and requests that would leave
this machine refused (see _record.py). Arguments are the CLI's:

    python tests/clients/litellm_proxy.py --model triton/ensemble \\
        --api_base http://localhost:8000/v2/models/ensemble/generate --port 4000
"""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download at start
os.environ.setdefault("LITELLM_TELEMETRY", "False")

import _record  # noqa: E402

_record.record_http(os.environ.get("CLIENT_RECORD"))

from litellm.proxy.proxy_cli import run_server  # noqa: E402

if __name__ == "__main__":
    run_server(prog_name="litellm")
