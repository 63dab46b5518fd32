"""The local stack: simulated vLLM groups, the picker, Envoy Gateway + Envoy, from one render of the
overlay a cluster would deploy. `python -m local.stack` is its command line (cli.py); README.md
here says which module does what. Tests and tools use `Stack`, `StackConfig` and `StackError`
from here."""

__all__ = ["Stack", "StackConfig", "StackError"]


def __getattr__(name: str):
    # Resolved on first use, so that importing one module of the package (say processes.py)
    # does not load the launcher and everything it needs.
    if name == "Stack":
        from local.stack.launcher import Stack
        return Stack
    if name in ("StackConfig", "StackError"):
        from local.stack import config
        return getattr(config, name)
    raise AttributeError(f"module 'local.stack' has no attribute {name!r}")
