"""Real vLLM engines for the picker's tests: the CPU build serving the tiny model (`make vllm`),
started with local.vllm_server (the project's one launcher) and stopped when the block ends.
Tests that use them skip where vLLM is not installed."""
from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from local import vllm_server
from local.vllm_server import VllmServer


def tiny_model_dir(tmp_path_factory) -> Path:
    """The built model with the tokenizer the current builder writes (a cache built by an older
    builder may hold another tokenizer.json; vLLM and the picker both read this directory)."""
    if not vllm_server.available():
        pytest.skip("real vLLM is not installed (make vllm)")
    from local.tinymodel.tokenizer import write_tokenizer
    out = tmp_path_factory.mktemp("tiny-model")
    for f in Path(vllm_server.MODEL_DIR).iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and f.is_file():
            (out / f.name).symlink_to(f.resolve())
    write_tokenizer(out)
    return out


@contextmanager
def running(servers: list[VllmServer], tmp_path_factory) -> Iterator[list[VllmServer]]:
    """Start every server at once (they load in parallel), wait until each is healthy, yield
    them; stop them all on the way out, whatever happened."""
    logs = tmp_path_factory.mktemp("vllm")
    procs = []
    try:
        for i, server in enumerate(servers):
            procs.append((server, vllm_server.start(server, logs / f"vllm-{i}.log"), i))
        for server, proc, i in procs:
            vllm_server.wait_ready(server, proc, logs / f"vllm-{i}.log")
        yield servers
    finally:
        for _, proc, _ in procs:
            vllm_server.stop(proc)
        shutil.rmtree(logs, ignore_errors=True)
