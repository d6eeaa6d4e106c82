#!/usr/bin/env bash
# Install llama-cpp-python (the llama.cpp engine) and llama.cpp's HF → GGUF converter into a venv.
#
# The package registry has no llama-cpp-python wheel for this platform, so it is built from its source package,
# once per machine: ~5 minutes on 2 cores (CMAKE_ARGS defaults to -DGGML_NATIVE=ON: kernels for this CPU). The
# source package and the wheel are kept in $LLMOPT_WHEELHOUSE (default ~/.cache/llmopt/wheels; the wheel in a
# folder named by the build flags and the CPU's instruction sets); later installs on the same CPU reuse them. The
# converter (convert_hf_to_gguf.py, conversion/, gguf-py/) comes from the same source package's llama.cpp tree
# and goes to <venv>/share/llama.cpp, where tasks/engines/llama_cpp/gguf.py runs it.
# Usage: infra/llama-cpp.sh VENV VERSION
set -euo pipefail
venv=$1 version=$2
house=${LLMOPT_WHEELHOUSE:-$HOME/.cache/llmopt/wheels}
pip=("$venv/bin/pip" --quiet --quiet --disable-pip-version-check)
sdist=$house/llama_cpp_python-$version.tar.gz
cmake_args=${CMAKE_ARGS:--DGGML_NATIVE=ON}
# The CPU's instruction sets: a native build runs only where they all exist, so the wheel is kept per build flags
# and instruction sets, and a home directory shared between machines never hands an AVX-512 build to an AVX2 CPU.
isa=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' \
  | grep -E '^(avx|amx|fma|f16c|sse|ssse|bmi|asimd|sve|i8mm|dotprod|fphp)' | sort -u | tr '\n' ' ' || true)
[ -n "$isa" ] || isa=$(uname -m)
# llama.cpp's AMX kernels, which -march=native compiles in on Sapphire Rapids and later, crash in
# ggml_backend_amx_mul_mat on the first quantized matmul (llama.cpp issue #20824, unfixed in 0.3.36's tree; measured
# here on SmolLM2 Q8_0/Q4_0/Q4_K_M): a native build leaves them out and keeps AVX-512/VNNI.
no_amx=
if [[ $cmake_args == *GGML_NATIVE=ON* && " $isa " == *" amx_int8 "* ]]; then
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
built=$house/$(printf '%s\n%s\n%s\n' "$cmake_args" "$no_amx" "$isa" | sha256sum | cut -c1-12)
mkdir -p "$house" "$built"
if [ ! -f "$sdist" ]; then
  "${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$house"
fi
wheels=("$built"/llama_cpp_python-"$version"-*.whl)
if [ ! -f "${wheels[0]}" ]; then
  echo "llama-cpp-python $version: building llama.cpp from source ($cmake_args${no_amx:+, $no_amx}), once per" \
    "machine (~5 min on 2 cores) ..."
  start=$SECONDS
  CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx" CMAKE_ARGS=$cmake_args \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) "${pip[@]}" wheel --no-deps "$sdist" -w "$built" &
  compiler=$!
  while kill -0 "$compiler" 2>/dev/null; do  # a line every 30 s, so a silent console is not taken for a hang
    for _ in 1 2 3 4 5 6; do sleep 5; kill -0 "$compiler" 2>/dev/null || break; done
    if kill -0 "$compiler" 2>/dev/null; then echo "  ... still compiling llama.cpp ($((SECONDS - start)) s)"; fi
  done
  wait "$compiler"
  echo "llama-cpp-python $version: built in $((SECONDS - start)) s; wheel kept in $built"
  wheels=("$built"/llama_cpp_python-"$version"-*.whl)
fi
"${pip[@]}" install --no-deps --force-reinstall "${wheels[0]}"
share=$venv/share/llama.cpp
tree=llama_cpp_python-$version/vendor/llama.cpp
rm -rf "$share" && mkdir -p "$share"
tar -xzf "$sdist" -C "$share" --strip-components=3 \
  "$tree/convert_hf_to_gguf.py" "$tree/conversion" "$tree/gguf-py" "$tree/LICENSE"
