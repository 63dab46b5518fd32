"""`python -m local.tinymodel tokenizer [--out DIR]`: train the tiny model's tokenizer into DIR
(default .cache/tiny-model) and print the directory and its fingerprint.
`python -m local.tinymodel model [--out DIR]`: write the random-weight Qwen2 beside it (needs torch
and transformers: run it with the vLLM virtualenv's python) and print the weights' fingerprint.
`python -m local.tinymodel lora [--out DIR] [--model DIR]`: write a LoRA adapter for that model
(peft's files; torch + safetensors, the vLLM virtualenv's python) and print its fingerprint."""

from __future__ import annotations

import argparse
from pathlib import Path

from local.tinymodel import DEFAULT_DIR
from local.tinymodel.tokenizer import fingerprint, write_tokenizer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m local.tinymodel", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    tok = sub.add_parser("tokenizer", help="train the tokenizer (tokenizer.json, tokenizer_config.json)")
    tok.add_argument("--out", type=Path, default=DEFAULT_DIR)
    model = sub.add_parser("model", help="the tokenizer, then config.json, "
                           "generation_config.json and model.safetensors")
    model.add_argument("--out", type=Path, default=DEFAULT_DIR)
    lora = sub.add_parser("lora", help="adapter_config.json and adapter_model.safetensors")
    lora.add_argument("--out", type=Path, default=DEFAULT_DIR.parent / "tiny-model-lora")
    lora.add_argument("--model", type=Path, default=DEFAULT_DIR, help="the base model's directory")
    args = p.parse_args(argv)
    if args.command == "tokenizer":
        out = write_tokenizer(args.out)
        print(f"{out} sha256={fingerprint(out)}")
    elif args.command == "model":
        from local.tinymodel.model import model_fingerprint, write_model  # needs torch
        out = write_model(args.out)
        print(f"{out} sha256={model_fingerprint(out)}")
    elif args.command == "lora":
        from local.tinymodel.lora import adapter_fingerprint, write_adapter  # needs torch
        out = write_adapter(args.out, args.model)
        print(f"{out} sha256={adapter_fingerprint(out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
