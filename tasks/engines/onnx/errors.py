"""ONNX Runtime's own words for an error, without the C++ frames it wraps them in."""

from __future__ import annotations

import re


def engine_says(exc: BaseException) -> str:
    """ONNX Runtime's own words for why a model did not load, without the C++ signatures and source positions it
    wraps them in ("Load model from …/model.onnx failed:Protobuf parsing failed.", "External initializer:
    lm_head.MatMul.weight_Q8 offset: … are out of bounds or can not be read in full.")."""
    text = str(exc).strip() or type(exc).__name__
    text = re.split(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", text)[-1]
    text = text.splitlines()[0]
    # "file.cc:74 onnxruntime::Class::Method(const Type&, …) Message": the message starts after the signature
    source = r"(?:/[^\s:]*/)?[\w-]+\.(?:cc|h|cpp):\d+ "  # a source position, with or without its folder
    text = re.sub(source + r"\S*\(.*?\)\s+(?=[A-Z])", "", text)
    text = re.sub("^" + source + r"\S+ ", "", text).strip()
    return text if len(text) <= 400 else text[:400] + "…"
