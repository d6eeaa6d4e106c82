"""Imported first by the server process that torch variants' measuring processes are forked from
(`processes.TORCH_PRELOAD`): that server imports transformers' model code, and with it torchao, whose chatter
("Failed to load …_C_cutlass_90a.so", torch's `_pytree` notices) reached the console in the middle of the
benchmark's progress lines. Where the CLI keeps a log file (`$LLMOPT_LOG_FILE`: not with --debug), the server's
libraries are quieted as the CLI's are and what they still print goes to that file, as the measuring processes'
own output does."""

from __future__ import annotations

import os

from tasks.quiet import output_to_log_file, quiet_libraries

if os.environ.get("LLMOPT_LOG_FILE"):
    quiet_libraries()
    output_to_log_file()
