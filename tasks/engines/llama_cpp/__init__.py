"""The llama.cpp engine: `runtime` (a GGUF through llama-cpp-python's C API), `export` (the `llama_cpp` technique:
file types, importance matrix, mixed precision), `gguf` (converter, quantizer, importance matrix), `gguf_convert`
(llama.cpp's converter run offline)."""
