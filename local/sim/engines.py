"""Engine models: KV capacity, batch limits and step-time constants of a deployment.

The derivation of `a10-qwq32b` is in local/README.md ("Engine model a10-qwq32b").
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineModel:
    name: str
    block_size: int               # tokens per KV block
    num_gpu_blocks: int           # KV capacity of the group, in blocks
    max_num_seqs: int             # most sequences in one batch
    max_num_batched_tokens: int   # token budget of one scheduler step (chunked prefill)
    max_model_len: int            # prompt + output limit per request
    pipeline_stages: int          # pipeline-parallel stages, run in series for one batch
    # Time of one forward pass in one stage = base + prefill tokens + decoding seqs + context.
    stage_base_s: float
    stage_prefill_token_s: float
    stage_decode_seq_s: float
    stage_context_token_s: float
    watermark: float = 0.01       # fraction of blocks kept free when admitting (vLLM V0 default)
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.95
    cache_dtype: str = "auto"

    def with_overrides(self, **changes) -> "EngineModel":
        return replace(self, **changes)


A10_QWQ32B = EngineModel(
    name="a10-qwq32b",
    block_size=16,
    num_gpu_blocks=2350,             # one V0 virtual engine's share: ~4,700 / PP 2 (see README)
    max_num_seqs=256,
    max_num_batched_tokens=2048,
    max_model_len=16384,
    pipeline_stages=2,
    stage_base_s=0.045,
    stage_prefill_token_s=0.0003,
    stage_decode_seq_s=0.0003,
    stage_context_token_s=0.11e-6,
)

# A tiny engine model for unit tests: small numbers that make admission and preemption easy to reason about.
TINY = EngineModel(
    name="tiny",
    block_size=4,
    num_gpu_blocks=16,
    max_num_seqs=4,
    max_num_batched_tokens=16,
    max_model_len=64,
    pipeline_stages=1,
    stage_base_s=0.01,
    stage_prefill_token_s=0.001,
    stage_decode_seq_s=0.002,
    stage_context_token_s=0.0,
    watermark=0.0,
)

ENGINE_MODELS = {m.name: m for m in (A10_QWQ32B, TINY)}
DEFAULT_ENGINE_MODEL = A10_QWQ32B.name  # the simulator's, the lab's and the local stack's


def get_engine_model(name: str) -> EngineModel:
    try:
        return ENGINE_MODELS[name]
    except KeyError:
        raise ValueError(f"unknown engine model {name!r}; known: {', '.join(sorted(ENGINE_MODELS))}") from None
