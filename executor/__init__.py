"""roseinfer.executor.

Torch-free names the command lines check flags against before torch loads.
"""

CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "FULL")
"""Which passes replay CUDA graphs, by vLLM's ``CUDAGraphMode`` names: decode
batches only (the default), or also prefill and mixed passes up to the attention
backend's limit (``--enforce-eager`` turns both off; see
:mod:`roseinfer.executor.graph_runner`)."""
