"""The llama_cpp runtime as the house reads it (:class:`~fractal_opt.engine.capabilities.Capabilities`)."""

from __future__ import annotations

from ...engine.capabilities import Capabilities, Idle

__all__ = ["CAPABILITIES"]

CAPABILITIES = Capabilities(
    name="llama_cpp",
    summary="llama.cpp's server on a GGUF file: xllamacpp in this process, or a llama-server child process (runtime_path)",
    engine="fractal_opt.runtimes.llama_cpp:LlamaCppEngine",
    refuses="fractal_opt.runtimes.llama_cpp.settings:REFUSALS",
    weights="gguf",
    options=frozenset({"path"}),
    packages=("xllamacpp",),
    # Continuous batching over slots: a request's logits depend on the batch it is decoded in.
    batch_invariant=False,
    token_prompts=True,  # every prompt arrives as the token ids fractal_opt rendered (weights/prompts.py)
    # llama.cpp counts the physical cores itself when the plan sets no count (settings.server_settings
    # states the same count); the threads pass's "already runs N threads" check does not assume it.
    default_threads=None,
    idle=Idle(threads="an idle server's worker threads, in this process (xllamacpp) or in its child", children="a llama-server when runtime_path is set",
              memory="the loaded GGUF and the KV cache it allocated at load (n_ctx), of the one resident server",
              pause=("one server resident at a time: activate() before each timed round reloads the plan about to be measured; a llama-server "
                     "child kept resident besides it has its process group stopped (SIGSTOP, SIGCONT after) during other engines' rounds"),
              evict="evict_except / clear_cache drop the resident server (it stops once no call uses it)"),
    telemetry=("activate_s",),  # the reload before a round, kept apart from the round's own time
    export_targets=("llama-server",),
    # A model's layers over rpc-servers (llama-server --rpc), and copies behind HAProxy: both need
    # the llama-server executable (runtime_path), whose children they are.
    placements=frozenset({"rpc", "replicas"}),
    knobs=(
        ("runtime", {"backend": "llama_cpp", "path": "native"},
         "llama-server built for this CPU (make setup-llama-native): the wheel's kernels are AVX2 only, this build uses AVX-512 and bf16 units where the CPU has them"),
        ("runtime", {"backend": "llama_cpp", "path": "native", "dtype": "bfloat16"},
         "the build for this CPU on the weights widened to BF16: its bf16 dot products, where the quantized kernels change answers"),
        ("flash_attention", {"mode": "on"}, "fused attention: one pass over the KV cache per token, and the shortest prefill of long prompts"),
        ("llama_batch", {"n_ubatch": 128}, "prefill in forward passes of 128 tokens: smaller matmuls whose weights stay in cache"),
        ("llama_batch", {"n_batch": 256, "n_ubatch": 256}, "a long prompt in 256-token steps: decoding slots wait a shorter step for their next token"),
        ("kv_cache", {"implementation": "quantized", "bits": 8, "backend": "native"}, "q8_0 keys and values: half the KV bytes each decode step reads"),
    ),
    evict="fractal_opt.runtimes.llama_cpp:evict_except",
    clear="fractal_opt.runtimes.llama_cpp:clear_cache",
)
