"""The transformers runtime as the house reads it (:class:`~fractal_opt.engine.capabilities.Capabilities`)."""

from __future__ import annotations

from ...engine.capabilities import Capabilities, Idle, Refusal

__all__ = ["CAPABILITIES", "REFUSALS"]

_NOT_CONTINUOUS = ("transformers reuses a prompt prefix's KV pages only in continuous batching's paged cache (a batching: continuous pass first)")

# The plan fields other runtimes read that transformers refuses away from their defaults (at the
# defaults they mean what transformers does anyway), in the order the reasons are listed. What
# needs a look at the plan as a whole (continuous batching's unsupported arguments, the semantic
# cache's embedder) is TransformersEngine.refuse's own.
REFUSALS: tuple[Refusal, ...] = (
    Refusal("hardware.flash_attention", lambda p: p.hardware.flash_attention != "auto", "llama.cpp's flash-attention switch (transformers picks its kernel with the attention pass)"),
    Refusal("hardware.runtime_path", lambda p: p.hardware.runtime_path is not None, "where to find vLLM"),
    Refusal("hardware.runtime_url", lambda p: p.hardware.runtime_url is not None, "a running vLLM server"),
    Refusal("hardware.tensor_parallel", lambda p: p.hardware.tensor_parallel != 1, "vLLM's tensor parallelism (transformers places layers with device_map)"),
    Refusal("hardware.pipeline_parallel", lambda p: p.hardware.pipeline_parallel != 1, "vLLM's pipeline parallelism (transformers places layers with device_map)"),
    *(Refusal(f"hardware.{name}", lambda p, n=name: bool(getattr(p.hardware, n)) and getattr(p.hardware, n) != "127.0.0.1",
              "llama.cpp's split over rpc-servers (transformers places layers with device_map)") for name in ("rpc_workers", "rpc_endpoints", "rpc_bind")),
    Refusal("scheduling.replicas", lambda p: p.scheduling.replicas != 1 or p.scheduling.replica_cores is not None,
            lambda p: (f"scheduling.replicas={p.scheduling.replicas}: copies of the plan run as server processes behind a router; the transformers runtime "
                       "serves in this process (llama_cpp with a llama-server executable, or vllm, offer replicas)")),
    Refusal("hardware.n_batch", lambda p: p.hardware.n_batch is not None, "llama.cpp's tokens per decode call; transformers' continuous batching takes its "
            "tokens per step from scheduling.cb_max_batch_tokens (batching pass, max_batch_tokens)"),
    Refusal("hardware.n_ubatch", lambda p: p.hardware.n_ubatch is not None, "llama.cpp's tokens per forward pass; transformers runs a prompt's prefill in one forward pass"),
    Refusal("scheduling.prefix_cache", lambda p: bool(p.scheduling.prefix_cache) and p.scheduling.batching != "continuous",
            lambda p: f"scheduling.prefix_cache=True: {_NOT_CONTINUOUS}"),
    Refusal("model.quant_backend", lambda p: p.model.quant_backend == "gguf", lambda p: (
        f"model.quant_backend='gguf' ({p.model.quant_method}): re-quantizes a GGUF file for the llama_cpp runtime; transformers quantizes with torchao, "
        "bitsandbytes or quanto")),
    Refusal("model.kv_backend", lambda p: p.model.kv_backend == "native",
            lambda p: "model.kv_backend='native': a llama.cpp / vLLM cache type; transformers quantizes its cache with quanto or hqq"),
)

CAPABILITIES = Capabilities(
    name="transformers",
    summary="Hugging Face transformers in this process (the baseline)",
    engine="fractal_opt.runtimes.transformers.engine:TransformersEngine",
    refuses=REFUSALS,
    weights="transformers",
    # Padded static batches and continuous batching change the shapes of the float reductions, so
    # a request's greedy tokens can differ with what it is batched with (the path_agreement guard).
    batch_invariant=False,
    token_prompts=True,  # every prompt arrives as the token ids fractal_opt rendered (weights/prompts.py)
    default_threads="torch_threads",  # torch's intra-op pool, as this process started it
    knobs=(
        ("attention", {"implementation": "sdpa"}, "torch's fused scaled-dot-product attention instead of the eager matmuls"),
        ("quantize", {"bits": 8, "backend": "torchao"}, "int8 weights (torchao): a quarter of float32's bytes read per token"),
    ),
    idle=Idle(threads="torch's intra-op pool, shared by every model in this process", children="none",
              memory="the weights of each cached model (the cache holds the plans being compared)",
              pause="nothing to pause: it computes only inside a call, and a round calls only the engine it measures",
              evict="evict_except / clear_cache drop cached models (then gc, and CUDA's cache on a GPU)"),
    export_targets=("transformers-serve", "generation-config"),
    evict="fractal_opt.runtimes.transformers.engine:evict_except",
    clear="fractal_opt.runtimes.transformers.engine:clear_cache",
)
