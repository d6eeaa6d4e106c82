"""The `quantize` step: weight quantization methods behind one step key. `methods.py` is the contract, one module
per method family registers its methods (torch dynamic, torchao, optimum-quanto, bitsandbytes, GPTQ onto torchao's
grid, gptqmodel), `step.py` is the technique and its settings."""
