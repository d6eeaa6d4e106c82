#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp engine) and llama.cpp's HF → GGUF converter into a venv.
#
# The package registry has no llama-cpp-python wheel for this platform, so it is built from its source package,
# once per machine: ~5 minutes on 2 cores (CMAKE_ARGS defaults to -DGGML_NATIVE=ON: kernels for this CPU). The
# source package and the wheel are kept in $LLMOPT_WHEELHOUSE (default ~/.cache/llmopt/wheels; the wheel in a
# folder named by the build flags and the CPU's flags); later installs on the same CPU reuse them in seconds. The
# converter (convert_hf_to_gguf.py, conversion/, gguf-py/) comes from the same source package's llama.cpp tree
# and goes to <venv>/share/llama.cpp, where tasks/build/gguf.py runs it.
# Usage: infra/llama-cpp.sh VENV VERSION
set -euo pipefail
venv=$1 version=$2
house=${LLMOPT_WHEELHOUSE:-$HOME/.cache/llmopt/wheels}
pip=("$venv/bin/pip" --quiet --quiet --disable-pip-version-check)
sdist=$house/llama_cpp_python-$version.tar.gz
cmake_args=${CMAKE_ARGS:--DGGML_NATIVE=ON}
# A native build runs only on CPUs with this one's instruction sets: the wheel is kept per build flags and CPU
# flags, so a home directory shared between machines never hands an AVX-512 build to an AVX2-only CPU.
cpu=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || uname -m)
built=$house/$(printf '%s\n%s\n' "$cmake_args" "$cpu" | sha256sum | cut -c1-12)
mkdir -p "$house" "$built"
if [ ! -f "$sdist" ]; then
  "${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$house"
fi
wheels=("$built"/llama_cpp_python-"$version"-*.whl)
if [ ! -f "${wheels[0]}" ]; then
  echo "llama-cpp-python $version: building llama.cpp from source ($cmake_args), once per machine (~5 min on 2 cores) ..."
  start=$SECONDS
  CMAKE_ARGS=$cmake_args CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${pip[@]}" wheel --no-deps "$sdist" -w "$built"
  echo "llama-cpp-python $version: built in $((SECONDS - start)) s; wheel kept in $built"
  wheels=("$built"/llama_cpp_python-"$version"-*.whl)
fi
"${pip[@]}" install --no-deps --force-reinstall "${wheels[0]}"
share=$venv/share/llama.cpp
tree=llama_cpp_python-$version/vendor/llama.cpp
rm -rf "$share" && mkdir -p "$share"
tar -xzf "$sdist" -C "$share" --strip-components=3 \
  "$tree/convert_hf_to_gguf.py" "$tree/conversion" "$tree/gguf-py" "$tree/LICENSE"
