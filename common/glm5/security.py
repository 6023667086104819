"""Transport security and caller identity, the same for every glm5 server and client.

- TLS for gRPC (and HTTPS for the router's HTTP API): a server with `--tls-cert/--tls-key` serves TLS only;
  with `--tls-ca` as well it requires client certificates from that CA (mutual TLS), and its own clients
  (router -> workers, gateway -> workers, trainer -> gateway/workers) present the same cert. Plain-text
  connections to a TLS port fail the handshake.
- API keys (vLLM's `--api-key`): `Authorization: Bearer <key>` on HTTP and as gRPC metadata; several keys
  at once so they can rotate; compared in constant time.
- The internal token: a worker started with one answers only callers that send it (its router, gateway and
  trainer), whatever else reaches its port; health checks stay open for the kubelet's probes.
- Admin RPCs (UpdateWeights): callers named by their client certificate (CN or a SAN) under mutual TLS, or
  holding the shared admin token otherwise. With neither configured they are refused.
Secrets come from flags, environment variables or files (a mounted Kubernetes Secret) and never reach a log
line: `Secret.__repr__` hides the value.
"""

from __future__ import annotations

import argparse
import dataclasses
import hmac
import os
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import grpc

from glm5.errors import ConfigError

ADMIN_TOKEN_METADATA = "x-glm5-admin-token"
# the deployment's internal token: every call to a worker but its health checks carries it (docs/security.md)
INTERNAL_TOKEN_METADATA = "x-glm5-internal-token"
LOOPBACK = "127.0.0.1"
# services any caller may reach even when a credential is required: the kubelet's probes carry none. Reflection is
# not among them: it describes the API to whoever may call it
OPEN_SERVICES = ("grpc.health.v1.Health",)


class Secret:
    """A secret string whose repr and str never show it (dataclass reprs, log lines, tracebacks, `json.dumps(...,
    default=str)`). Deliberately not a dataclass: `dataclasses.asdict` of a config holding one would turn it into
    `{"value": ...}`, which is how `glm5 rl` once wrote its admin token into summary.json. Pickling keeps the value
    (a spawned process gets the config it needs)."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    @property
    def value(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret(***)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and self.matches(other._value)

    def __hash__(self) -> int:
        return hash((Secret, self._value))

    def matches(self, presented: str) -> bool:
        # a header that was not UTF-8 arrives with surrogate escapes: compared as the bytes it was, never a 500
        return hmac.compare_digest(self.value.encode(), presented.encode("utf-8", "surrogatepass"))


def read_secrets(values: Sequence[str] = (), env: str | None = None, file: str | None = None,
                 what: str = "secret") -> tuple[Secret, ...]:  # fmt: skip
    """Secrets from flag values, one environment variable (comma-separated) and one file (one per line; a
    mounted Secret's key). Blank entries are ignored; a named variable or file that is missing is an error."""
    out = [v.strip() for v in values]
    if env:
        if env not in os.environ:
            raise ConfigError(f"{what}: environment variable {env} is not set")
        out += os.environ[env].split(",")
    if file:
        try:
            out += Path(file).read_text().splitlines()
        except OSError as exc:
            raise ConfigError(f"{what}: cannot read {file}: {exc.strerror}") from None
    return tuple(Secret(v.strip()) for v in out if v.strip())


def any_matches(secrets: Iterable[Secret], presented: str) -> bool:
    # every key is compared, so the time taken does not say which one was close
    return bool(sum(s.matches(presented) for s in secrets))


def bearer(header: str | None) -> str:
    if not header:
        return ""
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


# -- TLS ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsConfig:
    cert: str | None = None  # PEM certificate chain this process presents (server, and client under mTLS)
    key: str | None = None  # its private key
    ca: str | None = None  # PEM CA bundle: verifies peers; on a server it makes client certificates mandatory
    server_name: str | None = None  # the name clients expect in servers' certificates (default: the target host)
    # with a CA, a server requires client certificates (mutual TLS); the router's public API turns this off and
    # takes API keys instead, as its HTTP API does
    require_client_cert: bool = True

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise ConfigError(f"{flag}: {path} is not a readable file")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self) -> grpc.ServerCredentials:
        if not self.cert or not self.key:
            raise ConfigError("a TLS server needs --tls-cert and --tls-key")
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        mutual = self.ca is not None and self.require_client_cert
        return grpc.ssl_server_credentials(pair, root_certificates=self._read(self.ca) if mutual else None,
                                           require_client_auth=mutual)  # fmt: skip

    def channel_credentials(self) -> grpc.ChannelCredentials:
        # under mutual TLS the client presents its own certificate; without a CA the system roots verify
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca), private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )  # fmt: skip

    def ssl_context(self) -> ssl.SSLContext:
        """For an HTTPS server (the router's OpenAI API): server certificate only; clients authenticate with
        API keys, as OpenAI's do."""
        if not self.cert or not self.key:
            raise ConfigError("HTTPS needs a certificate and its key")
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


NO_TLS = TlsConfig()


def channel(target: str, tls: TlsConfig = NO_TLS,
            options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:  # fmt: skip
    """An asyncio channel to `target`, over TLS when `tls` is on."""
    if not tls.enabled:
        return grpc.aio.insecure_channel(target, options=list(options))
    opts = list(options)
    if tls.server_name:
        opts.append(("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(target, tls.channel_credentials(), options=opts)


def sync_channel(target: str, tls: TlsConfig = NO_TLS) -> grpc.Channel:
    if not tls.enabled:
        return grpc.insecure_channel(target)
    opts = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
    return grpc.secure_channel(target, tls.channel_credentials(), options=opts)


def add_port(server: grpc.aio.Server, address: str, tls: TlsConfig = NO_TLS) -> int:
    """Binds `address` (plain or TLS); 0 when it could not be bound."""
    if tls.enabled:
        return int(server.add_secure_port(address, tls.server_credentials()))
    return int(server.add_insecure_port(address))


def add_tls_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("transport security (docs/security.md)")
    g.add_argument("--tls-cert", help="PEM certificate: gRPC is served over TLS (and presented to peers with "
                   "--tls-ca)")  # fmt: skip
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", help="PEM CA bundle: verify peers; servers then require client certificates (mTLS)")
    g.add_argument("--tls-server-name", help="name expected in servers' certificates (default: the address host)")


def tls_from_args(a: argparse.Namespace) -> TlsConfig:
    return TlsConfig(a.tls_cert, a.tls_key, a.tls_ca, a.tls_server_name)


# -- gRPC interceptors ----------------------------------------------------------------------------------------

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


def _metadata(details: grpc.HandlerCallDetails, key: str) -> str:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v if isinstance(v, str) else v.decode(errors="replace")
    return ""


def rejecting(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with `code` before reading anything."""

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, message)
        yield  # an async generator, as streaming handlers are

    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def _service(method: str) -> str:
    return method.strip("/").split("/")[0]


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """`authorization: Bearer <key>` metadata on every call but health checks (reflection included)."""

    def __init__(self, keys: Sequence[Secret]) -> None:
        self.keys = tuple(keys)

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = await continuation(details)
        if handler is None or _service(details.method) in OPEN_SERVICES:
            return handler
        if not any_matches(self.keys, bearer(_metadata(details, "authorization"))):
            return rejecting(handler, grpc.StatusCode.UNAUTHENTICATED,
                             "a valid API key is required: metadata 'authorization: Bearer <key>'")  # fmt: skip
        return handler


class InternalTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """The deployment's internal token as x-glm5-internal-token metadata on every call but health checks
    (reflection included): a worker answers its own router, gateway and trainer, not whatever reaches its port."""

    def __init__(self, token: Secret) -> None:
        self.token = token

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = await continuation(details)
        if handler is None or _service(details.method) in OPEN_SERVICES:
            return handler
        presented = _metadata(details, INTERNAL_TOKEN_METADATA)
        if not (presented and self.token.matches(presented)):
            return rejecting(handler, grpc.StatusCode.UNAUTHENTICATED,
                             f"this server answers its deployment's internal callers only: metadata "
                             f"'{INTERNAL_TOKEN_METADATA}' is missing or wrong")  # fmt: skip
        return handler


def add_internal_token_arguments(p: argparse.ArgumentParser, server: bool = False) -> None:
    """--internal-token-file / --internal-token-env: a server requires the token, a client sends it."""
    g = p.add_argument_group("internal token (docs/security.md)")
    role = ("every call but health checks must carry it (without it: any caller, for local development only)"
            if server else "sent to the workers with every call")  # fmt: skip
    g.add_argument("--internal-token-file", help=f"file holding the deployment's internal token (a mounted Secret): "
                   f"{role}")  # fmt: skip
    g.add_argument("--internal-token-env", help="environment variable holding that token")


def internal_token_from_args(a: argparse.Namespace) -> Secret | None:
    """The internal token of --internal-token-file / --internal-token-env; naming a source that holds none is an
    error (a worker would otherwise answer anyone)."""
    tokens = read_secrets((), a.internal_token_env, a.internal_token_file, "internal token")
    if not tokens and (a.internal_token_env or a.internal_token_file):
        raise ConfigError("internal token: --internal-token-file / --internal-token-env holds no token")
    return tokens[0] if tokens else None


def internal_metadata(token: Secret | None) -> tuple[tuple[str, str], ...]:
    return ((INTERNAL_TOKEN_METADATA, token.value),) if token is not None else ()


@dataclass(frozen=True, slots=True)
class AdminPolicy:
    """Who may call the RPCs that change a server's state: peers whose client certificate (verified by the
    server's mTLS CA) names one of `identities` (CN or subjectAltName), or callers sending `token` as
    x-glm5-admin-token metadata. Nobody when neither is set."""

    token: Secret | None = None
    identities: frozenset[str] = frozenset()

    @property
    def configured(self) -> bool:
        return self.token is not None or bool(self.identities)

    def allows(self, details: grpc.HandlerCallDetails, auth_context: dict[str, list[bytes]]) -> bool:
        if self.identities:
            names = auth_context.get("x509_common_name", []) + auth_context.get("x509_subject_alternative_name", [])
            if any(n.decode(errors="replace") in self.identities for n in names):
                return True
        presented = _metadata(details, ADMIN_TOKEN_METADATA)
        return self.token is not None and bool(presented) and self.token.matches(presented)


NO_ADMIN = AdminPolicy()


class AdminInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Applies an AdminPolicy to the named methods answering once (full names, e.g. /glm5.v1.Worker/UpdateWeights)."""

    def __init__(self, methods: Iterable[str], policy: AdminPolicy) -> None:
        self.methods = frozenset(methods)
        self.policy = policy

    async def intercept_service(self, continuation: Continuation,
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = await continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        name = details.method.rsplit("/", 1)[-1]
        if not self.policy.configured:
            return rejecting(handler, grpc.StatusCode.PERMISSION_DENIED,
                             f"{name} is disabled on this server: start it with --admin-token-file or "
                             "--tls-ca and --admin-identity")  # fmt: skip
        assert not handler.response_streaming, "admin RPCs answer once"
        streaming = handler.request_streaming  # PushWeights: checked before the first message is read
        inner, policy = (handler.stream_unary if streaming else handler.unary_unary), self.policy

        async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if not policy.allows(details, context.auth_context()):
                await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                    f"{name}: the caller is not an administrator of this server")  # fmt: skip
            return await inner(request, context)

        make = grpc.stream_unary_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        return make(guarded, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)  # fmt: skip


def add_admin_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("administrative RPCs (docs/security.md)")
    g.add_argument("--admin-token-file", help="file holding the token admin callers send (a mounted Secret)")
    g.add_argument("--admin-token-env", help="environment variable holding that token")
    g.add_argument("--admin-identity", action="append", default=[],
                   help="client-certificate CN or SAN allowed admin RPCs under mTLS (repeatable)")  # fmt: skip


def admin_token_from_args(a: argparse.Namespace) -> Secret | None:
    """The admin token a server checks or a client sends (first entry of its file or variable)."""
    tokens = read_secrets((), a.admin_token_env, a.admin_token_file, "admin token")
    return tokens[0] if tokens else None


def admin_policy_from_args(a: argparse.Namespace) -> AdminPolicy:
    return AdminPolicy(admin_token_from_args(a), frozenset(a.admin_identity))


def admin_metadata(token: Secret | None) -> tuple[tuple[str, str], ...]:
    return ((ADMIN_TOKEN_METADATA, token.value),) if token is not None else ()


def redact_url(url: str) -> str:
    """A URL fit for a log line: its password (redis://:secret@host) replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


def public_view(value: Any) -> Any:
    """`value` (a config dataclass, and what it holds) as JSON-ready data fit for an output file users share: a
    Secret becomes "***" (that one was set, never what it is), a URL loses its password, paths become strings."""
    if isinstance(value, Secret):
        return "***"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: public_view(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): public_view(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [public_view(v) for v in value]
    if isinstance(value, str):
        return redact_url(value) if "@" in value and "://" in value else value
    if value is None or isinstance(value, bool | int | float):
        return value
    return str(value)


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


__all__ = [
    "ADMIN_TOKEN_METADATA",
    "INTERNAL_TOKEN_METADATA",
    "LOOPBACK",
    "NO_ADMIN",
    "NO_TLS",
    "AdminInterceptor",
    "AdminPolicy",
    "ApiKeyInterceptor",
    "InternalTokenInterceptor",
    "Secret",
    "TlsConfig",
    "add_admin_arguments",
    "add_internal_token_arguments",
    "add_port",
    "add_tls_arguments",
    "admin_metadata",
    "admin_policy_from_args",
    "admin_token_from_args",
    "any_matches",
    "bearer",
    "channel",
    "internal_metadata",
    "internal_token_from_args",
    "is_loopback",
    "read_secrets",
    "redact_url",
    "rejecting",
    "sync_channel",
    "tls_from_args",
]  # fmt: skip
