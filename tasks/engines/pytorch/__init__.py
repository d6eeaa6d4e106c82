"""The PyTorch engine: `runtime` (transformers on the CPU or a CUDA GPU, its batch decoders), `slots` (the batch
decoder for bfloat16/float16 Llama-shaped models over fixed KV rows), `tensor_parallel` (the model split over ranks
llmopt starts). Its weights formats are tasks/weights/; its variants come from the float model and the transform
and quantize techniques, so it has no export."""
