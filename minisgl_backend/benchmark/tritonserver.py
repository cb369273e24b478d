"""tritonserver and perf_analyzer from Python: find them, start and stop a server, set model
parameters in a `config.pbtxt`. Used by the `serving` benchmark and the tests' `triton_fixtures`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_ports(count: int) -> list[int]:
    """`count` distinct TCP ports free on loopback right now."""
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def http_status(url: str) -> int | None:
    """The HTTP status of a GET (None when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, urllib.error.URLError):
        return None


def triton_environment() -> dict[str, str]:
    """An environment with `tritonserver` and `perf_analyzer` on PATH.

    When both are on PATH already (a GPU host, an NGC container), the current environment
    (`TRITON_BACKEND_DIR`, when set, is the backend directory); otherwise the one that
    `scripts/triton_env.sh` sets up (it installs the wheels on first use).
    """
    env = dict(os.environ)
    if not (shutil.which("tritonserver") and shutil.which("perf_analyzer")):
        script = ". scripts/triton_env.sh >&2 && env -0"
        out = subprocess.run(["bash", "-c", script], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                             check=True).stdout
        env = dict(item.split("=", 1) for item in out.decode().split("\0") if "=" in item)
    # The copied models import minisgl_backend: from this source tree unless it is installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    return env


def set_parameters(config: str, values: dict[str, str]) -> str:
    """`config` (config.pbtxt text) with `parameters { key: K value: { string_value: V } }`
    set for every K in `values`; each must be there already."""
    for key, value in values.items():
        pattern = rf'(parameters {{ key: "{re.escape(key)}" value: {{ string_value: )"[^"]*"'
        config, count = re.subn(pattern, lambda m: f'{m.group(1)}"{value}"', config)
        if count != 1:
            raise KeyError(f"config.pbtxt has {count} parameters named {key!r}")
    return config


@dataclass
class Tritonserver:
    """A tritonserver started by `start`, in its own process group, logging to `log_path`."""

    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def model_metrics(self, model: str = "minisgl") -> dict[str, float]:
        """The `minisgl_*` samples of `model` on /metrics (name, with any labels other than
        the model's, -> value)."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as resp:
            text = resp.read().decode()
        samples = {}
        label = f'model="{model}"'
        for line in text.splitlines():
            if not line.startswith("minisgl_") or label not in line:
                continue
            key, value = line.rsplit(" ", 1)
            name, labels = key.split("{", 1)
            extra = ",".join(part for part in labels.rstrip("}").split(",")
                             if part and part != label)
            samples[f"{name}{{{extra}}}" if extra else name] = float(value)
        return samples

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    @classmethod
    def start(cls, repository: Path, log_path: Path, env: dict[str, str],
              extra_args: tuple[str, ...] = ()) -> Tritonserver:
        http_port, grpc_port, metrics_port = free_ports(3)
        command = ["tritonserver", f"--model-repository={repository}",
                   f"--http-port={http_port}", f"--grpc-port={grpc_port}",
                   f"--metrics-port={metrics_port}", "--disable-auto-complete-config",
                   *extra_args]
        if env.get("TRITON_BACKEND_DIR"):
            command.insert(1, f"--backend-directory={env['TRITON_BACKEND_DIR']}")
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        return cls(process, http_port, grpc_port, metrics_port, log_path)

    def wait_ready(self, timeout: float) -> None:
        """Until /v2/health/ready answers 200; RuntimeError when the server exits or `timeout`
        runs out (the caller stops it)."""
        deadline = time.monotonic() + timeout
        while http_status(f"{self.http_url}/v2/health/ready") != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                what = (f"exited with code {self.process.returncode}"
                        if self.process.poll() is not None else f"not ready in {timeout:.0f} s")
                raise RuntimeError(f"tritonserver {what} (log: {self.log_path})")
            time.sleep(0.5)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGTERM; SIGKILL to its process group (the Python stubs and engine processes) when
        it is not gone within `timeout` or leaves processes behind."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 10.0  # stubs notice their server's exit within seconds
        while _group_alive(self.process.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(self.process.pid):
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:
                pass
        if self.process.poll() is None:
            self.process.wait(timeout=30)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` is still running (zombies count as gone)."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False
