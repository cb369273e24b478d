"""Pack what a GPU host without a package index lacks into .carry/site.tar.xz (for `suite`).

The pinned wheels (CPython 3.12, manylinux x86_64) are downloaded into `--wheels` when missing,
then unpacked as they are (a wheel is a zip: unpacking installs a pure or self-contained
package) minus what the runs never load (the Python-backend stubs and libpython of other Python
versions, perf_analyzer's duplicate `perf_client`), and packed as one xz stream: about 55 MB,
where the wheels are 136 MB (a device call carries 64 MiB at most).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from minisgl_backend.benchmark.cli import REPO_ROOT

PINS = ("flashinfer-python==0.7.2.post1", "apache-tvm-ffi==0.1.15.post2", "xgrammar==0.2.9",
        "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0",
        "typing-inspection==0.4.5", "typing-extensions==4.16.0", "nvidia-pytriton==0.7.0",
        "tritonclient==2.51.0", "nvidia-cuda-runtime-cu12==12.6.77")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_35_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wheels", type=Path, default=REPO_ROOT / ".device-wheels",
                        help="where the wheels are kept (outside .carry/: only the pack travels)")


def run(args: argparse.Namespace) -> None:
    args.wheels.mkdir(parents=True, exist_ok=True)
    for pin in PINS:
        name, version = pin.split("==")
        if not list(args.wheels.glob(f"{name.replace('-', '_')}-{version}-*.whl")):
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            "--only-binary=:all:", "--python-version", "3.12",
                            "--implementation", "cp", "-d", str(args.wheels), pin,
                            *(f"--platform={p}" for p in PLATFORMS)], check=True)
    target = REPO_ROOT / ".carry" / "site.tar.xz"
    target.parent.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp)
        for wheel in args.wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as archive:
                for info in archive.infolist():  # keep the executables' mode (perf_analyzer)
                    path = archive.extract(info, site)
                    if info.external_attr >> 16:
                        os.chmod(path, info.external_attr >> 16)
        for stub in (site / "pytriton/tritonserver/python_backend_stubs").glob("*"):
            if stub.name != "3.12":
                shutil.rmtree(stub)
        for path in [*site.glob("nvidia_pytriton.libs/libpython3-*.13.so.*"),
                     *site.glob("tritonclient-*.data/data/bin/perf_client")]:
            path.unlink()
        subprocess.run(["tar", "-I", "xz -T0 -6", "-cf", str(target), "-C", str(site), "."],
                       check=True)
    print(f"{target}: {target.stat().st_size / 1e6:.1f} MB")
