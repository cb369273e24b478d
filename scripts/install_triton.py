#!/usr/bin/env python3
"""Get a real ``tritonserver`` and ``perf_analyzer`` on a CPU machine, without Docker.

What it does, into the environment of the interpreter that runs it (use the venv's python):

1. ``pip install`` whatever is missing of ``nvidia-pytriton==0.7.0`` (ships a complete
   Triton 2.51.0 build), ``tritonclient[all]==2.51.0`` (ships ``bin/perf_analyzer``) and
   ``nvidia-cuda-runtime-cu12`` (``libcudart.so.12``, needed by perf_analyzer).
2. Make sure ``libb64.so.0d`` (needed by perf_analyzer) can be loaded: apt-get
   ``libb64-0d`` when root, else fall back to the copy bundled with nvidia-pytriton.
3. Prepare ``<prefix>/tritonserver``: a writable copy of the wheel's server tree with the
   Python-backend stub for the running Python version at
   ``backends/python/triton_python_backend_stub``.
4. Write ``<prefix>/env.sh`` exporting ``PATH``, ``LD_LIBRARY_PATH`` and
   ``TRITON_BACKEND_DIR`` (empty = use the server's default backend directory).

If a ``tritonserver`` that is not ours is already on ``PATH`` (NGC container), step 3 is
skipped and that server is used with its default backend directory (``--use-wheel``
overrides). A relative ``--prefix`` is taken relative to the repository root.

Idempotent: a marker file records what was prepared; a second run only checks it. The last
line printed is the path of ``env.sh``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER_NAME = ".install-ok.json"
MARKER_FORMAT = 1

PYTRITON = ("nvidia-pytriton", "0.7.0")
CLIENT = ("tritonclient", "2.51.0")
CLIENT_EXTRA_DISTS = ("grpcio", "protobuf", "geventhttpclient", "aiohttp", "python-rapidjson",
                      "cuda-python", "numpy")
# 12.6.77 is the libcudart that nvidia-pytriton 0.7.0 bundles; any 12.x provides libcudart.so.12.
CUDART = ("nvidia-cuda-runtime-cu12", "12.6.77")

SYSTEM_LIB_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")


def log(msg: str) -> None:
    """Progress line on stdout."""
    print(f"[install_triton] {msg}", flush=True)


def warn(msg: str) -> None:
    """Warning line on stderr."""
    print(f"[install_triton] WARNING: {msg}", file=sys.stderr, flush=True)


def python_tag() -> str:
    """'3.11' for the running interpreter."""
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def marker_is_valid(prefix: Path, use_wheel: bool) -> bool:
    """True when a previous run prepared everything for this interpreter and it still exists."""
    try:
        data = json.loads((prefix / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if data.get("format") != MARKER_FORMAT or data.get("python_prefix") != sys.prefix:
        return False
    if data.get("python") != python_tag() or not (prefix / "env.sh").is_file():
        return False
    if data.get("external") != (None if use_wheel else find_external_tritonserver(prefix)):
        return False  # a tritonserver appeared on (or left) PATH: switch modes
    return all(Path(p).exists() for p in data.get("paths", []))


def write_marker(prefix: Path, external: str | None, paths: list[str]) -> None:
    """Record what this run prepared (see marker_is_valid)."""
    data = {"format": MARKER_FORMAT, "python_prefix": sys.prefix, "python": python_tag(),
            "external": external, "paths": paths}
    (prefix / MARKER_NAME).write_text(json.dumps(data, indent=1) + "\n")


def installed_version(dist: str) -> str | None:
    """Version of an installed distribution, or None."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def missing_requirements(want_server: bool) -> list[str]:
    """pip requirement strings for what is not installed yet."""
    reqs: list[str] = []
    if want_server and installed_version(PYTRITON[0]) != PYTRITON[1]:
        reqs.append(f"{PYTRITON[0]}=={PYTRITON[1]}")
    client_ok = installed_version(CLIENT[0]) == CLIENT[1]
    if not client_ok or any(installed_version(d) is None for d in CLIENT_EXTRA_DISTS):
        reqs.append(f"{CLIENT[0]}[all]=={CLIENT[1]}")
    if cudart_lib_dir() is None:
        reqs.append(f"{CUDART[0]}=={CUDART[1]}")
    return reqs


def pip_install(reqs: list[str]) -> None:
    """Install requirements into the running interpreter's environment (numpy stays <2)."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", *reqs, "numpy<2"]
    log("pip install " + " ".join(reqs))
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit("[install_triton] pip install failed: " + " ".join(reqs))


def dist_path(dist: str, rel: str) -> Path | None:
    """Absolute path of `rel` inside an installed distribution, if it exists."""
    from importlib import metadata

    try:
        path = Path(str(metadata.distribution(dist).locate_file(rel))).resolve()
    except metadata.PackageNotFoundError:
        return None
    return path if path.exists() else None


def cudart_lib_dir() -> Path | None:
    """Folder with libcudart.so.12 from nvidia-cuda-runtime-cu12, if installed."""
    lib = dist_path(CUDART[0], "nvidia/cuda_runtime/lib")
    return lib if lib is not None and (lib / "libcudart.so.12").exists() else None


def perf_analyzer_path() -> Path | None:
    """The perf_analyzer binary that the tritonclient wheel installed (…/bin/perf_analyzer)."""
    from importlib import metadata

    try:
        files = metadata.distribution(CLIENT[0]).files or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == "perf_analyzer" and f.parent.name == "bin":
            path = Path(str(f.locate())).resolve()
            if path.is_file():
                path.chmod(path.stat().st_mode | 0o111)
                return path
    return None


def ldconfig_has(soname: str) -> bool:
    """True when the dynamic linker cache knows `soname`."""
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True).stdout
    except OSError:
        return False
    return any(line.strip().startswith(soname + " ") for line in out.splitlines())


def run_quiet(cmd: list[str]) -> int:
    """Run a command non-interactively with stdout discarded (stderr still shows); exit code."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, env=env).returncode


def apt_install(package: str) -> bool:
    """apt-get install a Debian package (retrying after apt-get update); True on success."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    cmd = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", package]
    log(f"apt-get install {package}")
    if run_quiet(cmd) == 0:
        return True
    run_quiet(["apt-get", "update", "-qq"])
    return run_quiet(cmd) == 0


def ensure_libb64(prefix: Path, use_apt: bool = True) -> Path | None:
    """Make libb64.so.0d loadable for perf_analyzer; returns an extra lib dir, if one is needed."""
    if ldconfig_has("libb64.so.0d") or (use_apt and apt_install("libb64-0d")
                                        and ldconfig_has("libb64.so.0d")):
        return None
    libs = dist_path(PYTRITON[0], "nvidia_pytriton.libs")
    bundled = sorted(libs.glob("libb64-*.so.0d")) if libs else []
    if bundled:
        lib_dir = prefix / "lib"
        lib_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(bundled[0], lib_dir / "libb64.so.0d")
        log("libb64-0d not installable; using the copy bundled with nvidia-pytriton")
        return lib_dir
    warn("libb64.so.0d is missing and could not be installed (apt-get install libb64-0d as "
         "root): perf_analyzer will not run; tritonserver still works")
    return None


def libpython_dir() -> Path | None:
    """Folder holding this interpreter's libpython3.X.so.1.0 when it is not a system folder."""
    soname = sysconfig.get_config_var("INSTSONAME") or f"libpython{python_tag()}.so.1.0"
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    if libdir and (Path(libdir) / soname).exists():
        return None if libdir.rstrip("/").startswith(SYSTEM_LIB_DIRS) else Path(libdir)
    if not ldconfig_has(soname):
        warn(f"{soname} not found: the Python-backend stub cannot start (install a shared "
             f"Python build, or Debian's libpython{python_tag()})")
    return None


def find_external_tritonserver(prefix: Path) -> str | None:
    """A tritonserver on PATH that is not our own copy under `prefix` (NGC container case)."""
    ours = str(prefix.resolve())
    for d in os.environ.get("PATH", "").split(os.pathsep):
        cand = Path(d or ".") / "tritonserver"
        if cand.is_file() and os.access(cand, os.X_OK):
            real = str(cand.resolve())
            if not real.startswith(ours + os.sep):
                return str(cand)
    return None


def prepare_server_tree(prefix: Path) -> Path:
    """Copy the wheel's server tree to `prefix`/tritonserver with this Python's stub in place."""
    src = dist_path(PYTRITON[0], "pytriton/tritonserver")
    if src is None:
        raise SystemExit("[install_triton] nvidia-pytriton has no pytriton/tritonserver folder")
    stub = src / "python_backend_stubs" / python_tag() / "triton_python_backend_stub"
    if not stub.is_file():
        have = sorted(p.name for p in (src / "python_backend_stubs").iterdir())
        raise SystemExit(f"[install_triton] no Python-backend stub for Python {python_tag()} "
                         f"(the wheel has {', '.join(have)})")
    dst, tmp = prefix / "tritonserver", prefix / "tritonserver.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("python_backend_stubs", "__pycache__"))
    target = tmp / "backends" / "python" / "triton_python_backend_stub"
    shutil.copy2(stub, target)
    for exe in (target, tmp / "bin" / "tritonserver"):
        exe.chmod(0o755)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    log(f"server tree ready in {dst} (stub for Python {python_tag()})")
    return dst


ENV_SH_HEADER = r"""# Generated by scripts/install_triton.py; source it (. .triton/env.sh).
_triton_prepend() {  # VAR DIR: put DIR first in VAR unless it is already there
  eval "_triton_v=\${$1:-}"
  case ":$_triton_v:" in
    *":$2:"*) ;;
    *) eval "export $1=\"\$2\${_triton_v:+:\$_triton_v}\"" ;;
  esac
  unset _triton_v
}
"""


def render_env_sh(path_dirs: list[Path], lib_dirs: list[Path], backend_dir: Path | None) -> str:
    """Text of env.sh: prepends folders (once, however often it is sourced) and sets vars."""
    lines = [ENV_SH_HEADER.rstrip("\n")]
    # Prepend in reverse so the first folder listed ends up first.
    lines += [f"_triton_prepend {var} {shlex.quote(str(d))}" for var, dirs in
              (("LD_LIBRARY_PATH", lib_dirs), ("PATH", path_dirs)) for d in reversed(dirs)]
    lines.append("unset -f _triton_prepend")
    backend = shlex.quote(str(backend_dir) if backend_dir else "")
    lines.append(f"export TRITON_BACKEND_DIR={backend}  # empty: the server's default")
    return "\n".join(lines) + "\n"


def unique(paths: list[Path | None]) -> list[Path]:
    """Drop Nones and duplicates, keeping order."""
    return list(dict.fromkeys(p for p in paths if p is not None))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", default=".triton",
                    help="where to prepare the server (relative = under the repo root)")
    ap.add_argument("--force", action="store_true", help="redo everything, ignoring the marker")
    ap.add_argument("--use-wheel", action="store_true",
                    help="use the wheel's server even if a tritonserver is on PATH")
    ap.add_argument("--no-install", action="store_true",
                    help="install nothing (a host without a registry): prepare the server from "
                    "what is importable, e.g. wheels unpacked on PYTHONPATH; the client's "
                    "Python extras may be missing (perf_analyzer needs none of them)")
    return ap.parse_args(argv)


def install(prefix: Path, use_wheel: bool, no_install: bool = False) -> None:
    """Do the whole installation and write env.sh plus the marker."""
    external = None if use_wheel else find_external_tritonserver(prefix)
    if external:
        log(f"using the tritonserver already on PATH: {external}")
    reqs = missing_requirements(want_server=external is None)
    if reqs and no_install:
        warn("not installing (--no-install): " + " ".join(reqs))
    elif reqs:
        pip_install(reqs)
    prefix.mkdir(parents=True, exist_ok=True)
    b64_dir = ensure_libb64(prefix, use_apt=not no_install)
    cudart = cudart_lib_dir()
    perf = perf_analyzer_path()
    if perf is None or cudart is None:
        warn("perf_analyzer or libcudart.so.12 not found: perf_analyzer will not run")

    server_bin: Path | None = None
    backend_dir: Path | None = None
    lib_dirs: list[Path | None] = []
    if external is None:
        tree = prepare_server_tree(prefix)
        server_bin, backend_dir = tree / "bin", tree / "backends"
        lib_dirs += [dist_path(PYTRITON[0], "nvidia_pytriton.libs"), libpython_dir()]
    lib_dirs += [cudart, b64_dir]

    # The interpreter's scripts folder goes on PATH too: the Python-backend stub embeds
    # libpython and finds its environment through the first `python3` on PATH.
    scripts_dir = Path(sysconfig.get_path("scripts"))
    path_dirs = unique([server_bin, perf.parent if perf else None, scripts_dir])
    tmp_env = prefix / "env.sh.tmp"  # written aside and renamed: readers never see half a file
    tmp_env.write_text(render_env_sh(path_dirs, unique(lib_dirs), backend_dir))
    tmp_env.replace(prefix / "env.sh")
    kept = [str(p) for p in [*path_dirs, *unique(lib_dirs)]]
    write_marker(prefix, external, kept)


def main(argv: list[str] | None = None) -> int:
    """Entry point: fast marker check, else full install under a lock."""
    args = parse_args(argv)
    prefix = Path(args.prefix)
    prefix = (prefix if prefix.is_absolute() else REPO / prefix).resolve()
    if args.force or not marker_is_valid(prefix, args.use_wheel):
        import fcntl

        prefix.mkdir(parents=True, exist_ok=True)
        with open(prefix / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be installing right now
            if args.force or not marker_is_valid(prefix, args.use_wheel):
                install(prefix, args.use_wheel, args.no_install)
    print(prefix / "env.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
