#!/usr/bin/env bash
# Pack what the H200 host lacks into .carry/site.tar.xz, which benchmark/run_h200.sh unpacks on
# PYTHONPATH there (a host without a package registry; a device call carries 64 MiB at most).
#
#   benchmark/pack_carry.sh            # downloads the pinned wheels (CPython 3.12) if missing
#
# Wheels are unpacked as they are (a wheel is a zip: unpacking it installs a pure or
# self-contained package), minus what the runs never load: the Python-backend stubs and
# libpython of other Python versions, perf_analyzer's duplicate `perf_client`. As one xz
# stream the lot is about 55 MB, where the wheels alone are 136 MB.
set -eu
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.device-wheels}  # outside .carry/: only the packed file travels
PINS=(flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 xgrammar==0.2.9
      pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
      typing-extensions==4.16.0 nvidia-pytriton==0.7.0 tritonclient==2.51.0
      nvidia-cuda-runtime-cu12==12.6.77)
mkdir -p "$WHEELS"
for pin in "${PINS[@]}"; do
  name=${pin%%==*}; file=${name//-/_}
  if ! ls "$WHEELS/${file}-${pin##*==}"-*.whl > /dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp -d "$WHEELS" "$pin" \
      $(for n in 17 24 27 28 31 35; do echo --platform "manylinux_2_${n}_x86_64"; done) \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64
  fi
done
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
for wheel in "$WHEELS"/*.whl; do unzip -q -o "$wheel" -d "$SITE"; done
stubs="$SITE/pytriton/tritonserver/python_backend_stubs"
for stub in "$stubs"/*; do [ "$(basename "$stub")" = 3.12 ] || rm -rf "$stub"; done
rm -f "$SITE"/nvidia_pytriton.libs/libpython3-*.13.so.* \
  "$SITE"/tritonclient-*.data/data/bin/perf_client
tar -I "xz -T0 -6" -cf .carry/site.tar.xz -C "$SITE" .
ls -l .carry/site.tar.xz
