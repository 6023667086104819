"""`glm5 worker`: flags -> EngineConfig -> gRPC server."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import torch
from glm5.allocator import retain_freed_memory
from glm5.devices import resolve_device
from glm5.errors import ConfigError
from glm5.kernels import KERNEL_CHOICES
from glm5.model.quant import QUANTIZATION_CHOICES
from glm5.security import (
    LOOPBACK,
    add_admin_arguments,
    add_internal_token_arguments,
    add_tls_arguments,
    admin_policy_from_args,
    internal_token_from_args,
    tls_from_args,
)
from glm5.serving import add_connection_arguments, connection_limits_from_args
from glm5.units import parse_bytes

from glm5_worker.config import EngineConfig, SpeculativeConfig
from glm5_worker.parallel.driver import threads_per_rank
from glm5_worker.parallel.follower import run_follower_host
from glm5_worker.server.app import ServerSecurity, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    p.add_argument("--model", help="HuggingFace-format checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--served-model-name", help="name reported to clients (default: the directory name)")
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (0.0.0.0: every interface; the operator "
                   "renders it for pods)")  # fmt: skip
    p.add_argument("--port", type=int, default=50051, help="gRPC port (glm5.v1.Worker, health, reflection)")
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda", "npu"],
                   help="accelerator (auto: an Ascend NPU, else CUDA, else the CPU)")  # fmt: skip
    p.add_argument("--kernels", default=d.kernels, choices=KERNEL_CHOICES,
                   help="DSA kernels: auto = Triton on CUDA when installed, else portable PyTorch")  # fmt: skip
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations (auto: the checkpoint's)")  # fmt: skip
    p.add_argument("--quantization", default=d.quantization, choices=QUANTIZATION_CHOICES,
                   help="weight format the checkpoint must have: fp8 (block FP8), compressed-tensors (INT4 / FP8), "
                   "none (float); auto loads whatever it stores")  # fmt: skip
    p.add_argument("--max-model-len", type=int, help="context limit (default min(131072, checkpoint limit))")
    p.add_argument("--rope-scaling", choices=["linear", "yarn"], help="override the checkpoint's RoPE scaling")
    p.add_argument("--rope-factor", type=float, help="RoPE scaling factor, a power of two")
    p.add_argument("--rope-original-max-position-embeddings", type=int,
                   help="context the model was trained on, for --rope-scaling (default: the checkpoint's)")  # fmt: skip
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    p.add_argument("--kv-cache-bytes", default="auto", help="KV pool size ('auto', or e.g. 512MiB, 4GiB)")
    p.add_argument("--kv-memory-fraction", type=float, default=d.kv_memory_fraction,
                   help="--kv-cache-bytes auto: share of free device memory for the pool (kv-cache.md)")  # fmt: skip
    p.add_argument("--no-kv-int8-tier", action="store_true", help="keep every token at model precision")
    p.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="L1 latents and rope keys (auto: the model dtype); bfloat16 halves them for a float32 "
                   "model, read back into float32 for attention")  # fmt: skip
    p.add_argument("--kv-index-dtype", default=d.kv_index_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="L1 indexer keys (auto: --kv-cache-dtype); bfloat16 halves them for a float32 model and "
                   "speeds up long-context top-k selection")  # fmt: skip
    p.add_argument("--l1-tokens", type=int, default=d.l1_tokens, help="recent tokens kept at model precision")
    p.add_argument("--cache-event-log", type=int, default=d.cache_event_log,
                   help="prefix-cache events kept for routers that route by cache (--routing kv); a router further "
                        "behind gets a snapshot")  # fmt: skip
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="per-step budget")
    p.add_argument("--max-waiting", type=int, default=d.max_waiting, help="queued requests; beyond it they are refused")
    p.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens,
                   help="max new tokens of a request that sets none")  # fmt: skip
    p.add_argument("--dense-warmup-tokens", type=int, default=d.dense_warmup_tokens, help="0 disables it")
    p.add_argument("--dynamic-sparsity", action="store_true", help="widen top-k when attention entropy is low")
    p.add_argument("--sparsity-entropy-threshold", type=float, default=d.sparsity_entropy_threshold,
                   help="--dynamic-sparsity: widen top-k below this mean attention entropy (nats)")  # fmt: skip
    p.add_argument("--sparsity-patience", type=int, default=d.sparsity_patience,
                   help="--dynamic-sparsity: measurements below (or back above) the threshold to act")  # fmt: skip
    p.add_argument("--sparsity-widen-factor", type=float, default=d.sparsity_widen_factor,
                   help="--dynamic-sparsity: top-k multiplier when widening")  # fmt: skip
    c = p.add_argument_group("compiled decode steps (docs/worker.md)")
    c.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=d.enforce_eager,
                   help="run every step eagerly (default: decode steps of up to --compile-max-batch sequences run "
                   "as compiled graphs, compiled at start-up and cached on disk; CPU only so far)")  # fmt: skip
    c.add_argument("--compile-max-batch", type=int, default=d.compile_max_batch,
                   help="largest decode batch that runs compiled (larger ones are not dispatch-bound)")  # fmt: skip
    c.add_argument("--compile-cache-dir", help="where compiled steps are kept between starts (default: "
                   "$GLM5_COMPILE_CACHE or ~/.cache/glm5/compile)")  # fmt: skip
    c.add_argument("--compile-budget", type=float, default=d.compile_budget_s,
                   help="seconds start-up may spend compiling; shapes not compiled by then run eagerly")  # fmt: skip
    p.add_argument("--speculative-config", default="auto", metavar="JSON",
                   help='speculative decoding, vLLM\'s flag and keys: \'{"method": "mtp", "num_speculative_tokens": '
                   '3}\' drafts with the checkpoint\'s MTP layer, method "ngram" by prompt lookup '
                   "(prompt_lookup_max/min); disable_by_batch_size turns it off in steps of more decoding "
                   "sequences; auto: mtp (3 drafts) where the checkpoint stores an MTP layer, on an accelerator; "
                   "none: off (docs/worker.md)")  # fmt: skip
    p.add_argument("--ascend-temperature-floor", type=float, default=d.ascend_temperature_floor,
                   help="on an Ascend NPU a temperature in (0, floor) is raised to it; 0 stays greedy")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed, help="sampler seed of requests without their own")
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds to drain running requests")
    t = p.add_argument_group("one replica over several devices (docs/scaling.md)")
    t.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="devices (ranks) one model replica spans; the worker starts ranks 1..N-1 itself")  # fmt: skip
    t.add_argument("--expert-parallel", action=argparse.BooleanOptionalAction, default=None,
                   help="partition the routed experts over the ranks (default: on when the size is > 1); "
                   "--no-expert-parallel splits every expert's intermediate dimension instead")  # fmt: skip
    t.add_argument("--nnodes", type=int, default=d.nnodes, help="hosts (pods) the replica spans")
    t.add_argument("--node-rank", type=int, default=d.node_rank,
                   help="this host's index; hosts other than 0 run follower ranks only (no gRPC server)")  # fmt: skip
    t.add_argument("--master-addr", default=d.master_addr, help="host of rank 0 (the first pod's DNS name)")
    t.add_argument("--master-port", type=int, default=d.master_port, help="rank 0's rendezvous port (0: any)")
    t.add_argument("--collective-timeout", type=float, default=d.collective_timeout_s,
                   help="seconds a collective may take before the replica is declared lost")  # fmt: skip
    t.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s,
                   help="seconds the ranks wait for each other to start and to load their shards")  # fmt: skip
    add_tls_arguments(p)
    add_connection_arguments(p)
    add_internal_token_arguments(p, server=True)
    add_admin_arguments(p)
    p.add_argument("--health-port", type=int, help="also answer gRPC health checks in plain text on this port "
                   "(Kubernetes' probes cannot speak TLS)")  # fmt: skip
    p.add_argument("--weights-root", help="the only directory UpdateWeights may load checkpoints from (default: "
                   "UpdateWeights is refused); it may appear after the worker starts")  # fmt: skip
    p.add_argument("--no-retain-host-memory", action="store_true",
                   help="let glibc give freed host memory back to the kernel (its default; each step then faults "
                   "its pages in again)")  # fmt: skip


def config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=a.model,
        served_model_name=a.served_model_name,
        dtype=a.dtype,
        quantization=a.quantization,
        device=a.device,
        kernels=a.kernels,
        max_model_len=a.max_model_len,
        rope_scaling=a.rope_scaling,
        rope_factor=a.rope_factor,
        rope_original_max_position_embeddings=a.rope_original_max_position_embeddings,
        block_size=a.block_size,
        kv_cache_bytes=parse_bytes(a.kv_cache_bytes),
        kv_memory_fraction=a.kv_memory_fraction,
        kv_int8_tier=not a.no_kv_int8_tier,
        kv_cache_dtype=a.kv_cache_dtype,
        kv_index_dtype=a.kv_index_dtype,
        l1_tokens=a.l1_tokens,
        enable_prefix_caching=not a.no_prefix_caching,
        cache_event_log=a.cache_event_log,
        max_num_seqs=a.max_num_seqs,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_waiting=a.max_waiting,
        default_max_new_tokens=a.default_max_new_tokens,
        dense_warmup_tokens=a.dense_warmup_tokens,
        dynamic_sparsity=a.dynamic_sparsity,
        sparsity_entropy_threshold=a.sparsity_entropy_threshold,
        sparsity_patience=a.sparsity_patience,
        sparsity_widen_factor=a.sparsity_widen_factor,
        ascend_temperature_floor=a.ascend_temperature_floor,
        enforce_eager=a.enforce_eager,
        compile_max_batch=a.compile_max_batch,
        compile_cache_dir=a.compile_cache_dir,
        compile_budget_s=a.compile_budget,
        seed=a.seed,
        tensor_parallel_size=a.tensor_parallel_size,
        expert_parallel=a.expert_parallel,
        nnodes=a.nnodes,
        node_rank=a.node_rank,
        master_addr=a.master_addr,
        master_port=a.master_port,
        collective_timeout_s=a.collective_timeout,
        startup_timeout_s=a.startup_timeout,
        # the device named, not checked here (a rendered config is read where the device is absent)
        speculative=SpeculativeConfig.parse(
            a.speculative_config, resolve_device("auto").type if a.device == "auto" else a.device
        ),
    )


def security_from_args(a: argparse.Namespace) -> ServerSecurity:
    root = Path(a.weights_root) if a.weights_root else None
    if root is not None and root.exists() and not root.is_dir():
        raise ConfigError(f"--weights-root {root} is not a directory")
    # a root that does not exist yet is fine: a volume may be mounted, or a trainer create it, later
    return ServerSecurity(
        tls_from_args(a),
        admin_policy_from_args(a),
        root,
        a.health_port,
        internal_token_from_args(a),
        connection_limits_from_args(a),
    )


def run(a: argparse.Namespace) -> None:
    """Exits non-zero when the replica is lost (a rank died or hung), so the pod restarts."""
    config = config_from_args(a)
    security = security_from_args(a)
    rank = "rank0 " if config.tensor_parallel_size > 1 and config.node_rank == 0 else ""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {rank}%(name)s: %(message)s")
    if not a.no_retain_host_memory:
        retain_freed_memory()  # before the model loads, so every later allocation follows it
    threads = threads_per_rank(config) if config.tensor_parallel_size > 1 else 0
    if threads and resolve_device(config.device).type == "cpu":
        torch.set_num_threads(threads)  # the host's cores are shared by its ranks
    if config.node_rank > 0:
        sys.exit(run_follower_host(config, threads))
    sys.exit(asyncio.run(serve_until_signal(config, a.host, a.port, a.shutdown_grace, security)))
