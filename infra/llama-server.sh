#!/usr/bin/env bash
# Build llama.cpp's own HTTP server (llama-server), a peer for `llmopt loadtest --peer`, from the llama-cpp-python
# source package the install already fetched (the same llama.cpp tree as the engine), once per CPU: ~5 min on 2
# cores. Kept beside the engine's wheel in $LLMOPT_WHEELHOUSE (default ~/.cache/llmopt/wheels), in a folder named
# by the build flags and the CPU's instruction sets; prints the binary's path. Not part of `make run`.
# Usage: infra/llama-server.sh VERSION
set -euo pipefail
version=$1
house=${LLMOPT_WHEELHOUSE:-$HOME/.cache/llmopt/wheels}
sdist=$house/llama_cpp_python-$version.tar.gz
[ -f "$sdist" ] || { echo "$sdist: missing; run 'make install' first (it fetches the source package)" >&2; exit 1; }
isa=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' \
  | grep -E '^(avx|amx|fma|f16c|sse|ssse|bmi|asimd|sve|i8mm|dotprod|fphp)' | sort -u | tr '\n' ' ' || true)
[ -n "$isa" ] || isa=$(uname -m)
# as infra/llama-cpp.sh: llama.cpp's AMX kernels crash on quantized matmuls in this tree, so a native build on a CPU
# with AMX leaves them out (AVX-512/VNNI stay)
no_amx=
[[ " $isa " == *" amx_int8 "* ]] && no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
built=$house/server-$(printf '%s\n%s\n%s\n' "$version" "$no_amx" "$isa" | sha256sum | cut -c1-12)
binary=$built/llama-server
if [ ! -x "$binary" ]; then
  echo "llama-server ($version): building from $sdist, once per machine (~5 min on 2 cores) ..." >&2
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  tar -xzf "$sdist" -C "$work" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
  cmake -S "$work" -B "$work/build" -DGGML_NATIVE=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_OPENSSL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" >"$work/cmake.log" 2>&1 \
    || { tail -20 "$work/cmake.log" >&2; exit 1; }
  cmake --build "$work/build" --target llama-server -j"$(nproc)" >>"$work/cmake.log" 2>&1 \
    || { tail -20 "$work/cmake.log" >&2; exit 1; }
  mkdir -p "$built"
  cp "$work/build/bin/llama-server" "$binary"  # static: nothing else to carry
fi
echo "$binary"
