"""A throwaway certificate authority for TLS tests: a CA, a server certificate for localhost / 127.0.0.1, and
client certificates with a chosen common name (what mutual TLS identifies callers by)."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path

    def flags(self, ca: Path) -> tuple[str, ...]:
        return ("--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(ca))


class TestCA:
    __test__ = False  # a helper, not a test class

    def __init__(self, folder: Path, name: str = "glm5 test CA") -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            self._builder(self.name, self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.path = folder / "ca.pem"
        self.path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))

    def _builder(self, subject: x509.Name, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.name if hasattr(self, "name") else subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def issue(self, common_name: str, server: bool = False) -> Pair:
        """A leaf certificate named `common_name` (also its DNS SAN); server ones also name localhost and
        127.0.0.1, the addresses the tests dial."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        names: list[x509.GeneralName] = [x509.DNSName(common_name)]
        if server:
            names += [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        cert = (
            self._builder(subject, key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        pair = Pair(self.folder / f"{common_name}.pem", self.folder / f"{common_name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        pair.key.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        return pair
