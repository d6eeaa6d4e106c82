"""Run llama.cpp's `convert_hf_to_gguf.py` on an HF folder (a subprocess of tasks.engines.llama_cpp.gguf.convert_to_gguf).

Usage: python -m tasks.engines.llama_cpp.gguf_convert CONVERTER SOURCE_FOLDER OUT_FILE

The one change to the converter: a BPE pre-tokenizer llama.cpp does not know (a tokenizer trained for a test, a
new model family) is recorded as "default" with a warning instead of stopping the conversion. llmopt tokenizes with
the Hugging Face tokenizer beside every GGUF and hands llama.cpp token ids, so llama.cpp's own pre-tokenizer never
runs in llmopt; a user who runs the file with llama.cpp's tokenizer is told in the variant's notes.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path


def main() -> None:
    converter, source, out_file = (Path(arg) for arg in sys.argv[1:4])
    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    from conversion import base  # the converter's own package, from its llama.cpp tree

    recognised = base.TextModel.get_vocab_base_pre

    def tolerant(self, tokenizer):  # noqa: ANN001, ANN202 (the converter's signature)
        try:
            return recognised(self, tokenizer)
        except NotImplementedError:
            print("llmopt: unknown pre-tokenizer, recorded as 'default'", file=sys.stderr)
            return "default"

    base.TextModel.get_vocab_base_pre = tolerant
    sys.argv = [str(converter), str(source), "--outfile", str(out_file), "--outtype", "f32"]
    runpy.run_path(str(converter), run_name="__main__")


if __name__ == "__main__":
    main()
