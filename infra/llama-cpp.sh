#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp engine) and llama.cpp's HF → GGUF converter into a venv.
#
# The package registry has no llama-cpp-python wheel for this platform, so it is built from its source package,
# once per machine: ~5 minutes on 2 cores (CMAKE_ARGS defaults to -DGGML_NATIVE=ON: kernels for this CPU). The
# source package and the wheel are kept in $LLMOPT_WHEELHOUSE (default ~/.cache/llmopt/wheels); later installs
# reuse them in seconds. The converter (convert_hf_to_gguf.py, conversion/, gguf-py/) comes from the same source
# package's llama.cpp tree and goes to <venv>/share/llama.cpp, where tasks/build/gguf.py runs it.
# Usage: infra/llama-cpp.sh VENV VERSION
set -euo pipefail
venv=$1 version=$2
house=${LLMOPT_WHEELHOUSE:-$HOME/.cache/llmopt/wheels}
pip=("$venv/bin/pip" --quiet --quiet --disable-pip-version-check)
sdist=$house/llama_cpp_python-$version.tar.gz
mkdir -p "$house"
if [ ! -f "$sdist" ]; then
  "${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$house"
fi
wheels=("$house"/llama_cpp_python-"$version"-*.whl)
if [ ! -f "${wheels[0]}" ]; then
  echo "llama-cpp-python $version: building llama.cpp from source, once per machine (~5 min on 2 cores) ..."
  start=$SECONDS
  CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    "${pip[@]}" wheel --no-deps "$sdist" -w "$house"
  echo "llama-cpp-python $version: built in $((SECONDS - start)) s; wheel kept in $house"
  wheels=("$house"/llama_cpp_python-"$version"-*.whl)
fi
"${pip[@]}" install --no-deps --force-reinstall "${wheels[0]}"
share=$venv/share/llama.cpp
tree=llama_cpp_python-$version/vendor/llama.cpp
rm -rf "$share" && mkdir -p "$share"
tar -xzf "$sdist" -C "$share" --strip-components=3 \
  "$tree/convert_hf_to_gguf.py" "$tree/conversion" "$tree/gguf-py" "$tree/LICENSE"
