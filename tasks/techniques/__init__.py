"""Building variants: a recipe's steps (prune, distill, quantize, ONNX export) applied to the base model."""
