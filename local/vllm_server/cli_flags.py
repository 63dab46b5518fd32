"""Print every long flag of `vllm serve` in the installed vLLM, one a line (validation keeps the
list of the version the cluster pins in validation/vllm-cli/<image tag>.txt):

    .venv-vllm/bin/python -m local.vllm_server.cli_flags > validation/vllm-cli/v0.32.0.txt

Runs with the vLLM virtualenv's python (it imports vLLM's own argument parser)."""

from __future__ import annotations

from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser


def main() -> None:
    parser = make_arg_parser(FlexibleArgumentParser())
    flags = sorted({o for a in parser._actions for o in a.option_strings if o.startswith("--")})
    print("\n".join(flags))


if __name__ == "__main__":
    main()
