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
from glm5.settings import add_flags, from_flags

from glm5_worker.config import EngineConfig, SpeculativeConfig
from glm5_worker.parallel.driver import threads_per_rank
from glm5_worker.parallel.follower import run_follower_host
from glm5_worker.server.app import ServerSecurity, serve_until_signal


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, EngineConfig)  # the engine's settings; what follows is this process's
    p.add_argument("--host", default=LOOPBACK, help="address to listen on (0.0.0.0: every interface; the operator "
                   "renders it for pods)")  # fmt: skip
    p.add_argument("--port", type=int, default=50051, help="gRPC port (glm5.v1.Worker, health, reflection)")
    p.add_argument("--speculative-config", default="auto", metavar="JSON",
                   help='speculative decoding, vLLM\'s flag and keys: \'{"method": "mtp", "num_speculative_tokens": '
                   '3}\' drafts with the checkpoint\'s MTP layer, method "ngram" by prompt lookup '
                   "(prompt_lookup_max/min); disable_by_batch_size turns it off in steps of more decoding "
                   "sequences; auto: mtp (3 drafts) where the checkpoint stores an MTP layer, on an accelerator; "
                   "none: off (docs/worker.md)")  # fmt: skip
    p.add_argument("--shutdown-grace", type=float, default=30.0, help="seconds to drain running requests")
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
    # the device named, not checked here (a rendered config is read where the device is absent)
    device = resolve_device("auto").type if a.device == "auto" else a.device
    return from_flags(EngineConfig, a, speculative=SpeculativeConfig.parse(a.speculative_config, device))


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
