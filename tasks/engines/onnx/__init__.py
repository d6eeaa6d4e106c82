"""The ONNX Runtime GenAI engine: `runtime` (the graph through onnxruntime-genai, and the batch decoder on plain
ONNX Runtime), `export` (the `onnx_genai` technique: the model builder, int4/int8 rounding, mixed precision),
`weights` (reading and rewriting the builder's stored weights)."""
