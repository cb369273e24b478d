#!/usr/bin/env python3
"""Create (or reuse) the virtual environment of one third-party client and print its path.

    python scripts/client_venv.py NAME        # NAME: one of CLIENTS below

Each client lives in its own venv under `.client-venvs/NAME` (git-ignored; the folder can be
moved with CLIENT_VENVS_DIR), made with `python -m venv` by the interpreter that runs this script
and filled with `pip install` of the pinned requirements, because their dependencies would
change numpy / transformers / grpcio in the project's own .venv. A venv whose marker file holds
the same requirements and Python version is reused as it is; any other is rebuilt from scratch.

Exit status: 0 (path on stdout), 3 when pip could not reach the package index (no network; its
output on stderr), 1 for any other failure.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# Pinned: what tests/test_clients.py, tests/test_openai_clients.py and scripts/genai_perf.sh
# were checked with.
# litellm: 1.105.7 is the newest whose `proxy` extra installs from the index (1.106 to 1.109
# pin litellm-proxy-extras releases that are not published; 1.110 needs litellm-proxy, absent).
CLIENTS: dict[str, list[str]] = {
    "llamaindex": ["llama-index-llms-nvidia-triton==0.6.0"],
    "litellm": ["litellm[proxy]==1.105.7", "openai==2.54.0"],
    "genai-perf": ["genai-perf==0.0.16"],
    # transformers 4: AIPerf's count of a chat-templated prompt expects the token list that
    # apply_chat_template(tokenize=True) returned before transformers 5.
    "aiperf": ["aiperf==0.13.0", "transformers==4.57.6"],
}

MARKER = ".client-venv.json"
EXIT_NO_NETWORK = 3
PIP_TIMEOUT_S = 900

# What pip prints when the index cannot be reached (DNS, refused, unreachable, proxy, timeout).
_NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|Network is unreachable|No route to host|"
    r"Connection refused|ConnectTimeoutError|ReadTimeoutError|ProxyError|"
    r"Max retries exceeded|connection broken|Could not fetch URL", re.IGNORECASE)


class NoNetwork(RuntimeError):
    """pip could not reach the package index."""


def venvs_dir() -> Path:
    return Path(os.environ.get("CLIENT_VENVS_DIR") or REPO_ROOT / ".client-venvs")


def _marker(requirements: list[str]) -> dict:
    return {"requirements": requirements, "python": sys.version.split()[0]}


def _usable(venv: Path, requirements: list[str]) -> bool:
    try:
        if json.loads((venv / MARKER).read_text()) != _marker(requirements):
            return False
    except (OSError, ValueError):
        return False
    python = venv / "bin" / "python"
    return python.exists() and subprocess.run([str(python), "-c", "pass"],
                                              capture_output=True).returncode == 0


def _pip_output(text: str) -> str:
    """pip's output without the warnings about this machine's local index folders."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith("WARNING: Location ")).strip()


def ensure_client_venv(name: str) -> Path:
    """The venv of client `name`, created and filled first when needed. Raises NoNetwork when
    pip cannot reach the index, RuntimeError for other failures (pip's output in the message)."""
    requirements = CLIENTS[name]
    root = venvs_dir()
    root.mkdir(parents=True, exist_ok=True)
    venv = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (parallel tests, scripts)
        if _usable(venv, requirements):
            return venv
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        python = str(venv / "bin" / "python")
        proc = subprocess.run(
            [python, "-m", "pip", "install", "--disable-pip-version-check", "--no-input",
             *requirements],
            capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        if proc.returncode != 0:
            output = _pip_output(proc.stdout + proc.stderr)
            shutil.rmtree(venv, ignore_errors=True)
            message = f"pip install {' '.join(requirements)} failed:\n{output[-4000:]}"
            if _NETWORK_ERRORS.search(output):
                raise NoNetwork(message)
            raise RuntimeError(message)
        (venv / MARKER).write_text(json.dumps(_marker(requirements)))
        return venv


def main() -> int:
    if len(sys.argv) != 2 or sys.argv[1] not in CLIENTS:
        print(f"usage: {sys.argv[0]} {{{','.join(CLIENTS)}}}", file=sys.stderr)
        return 2
    try:
        venv = ensure_client_venv(sys.argv[1])
    except NoNetwork as exc:
        print(exc, file=sys.stderr)
        return EXIT_NO_NETWORK
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(exc, file=sys.stderr)
        return 1
    print(venv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
