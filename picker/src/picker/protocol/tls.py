"""Server TLS: certificates from --cert-path (tls.crt/tls.key) or a self-signed one made at start."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def self_signed(common_name: str = "inference-gateway-ext-proc") -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM), valid one year, for localhost and the picker Service names."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.DNSName(common_name), x509.DNSName("localhost"),
            x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=365))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    return key_pem, cert.public_bytes(serialization.Encoding.PEM)


def load_cert_dir(path: str | Path) -> tuple[bytes, bytes]:
    d = Path(path)
    key, crt = d / "tls.key", d / "tls.crt"
    for f in (key, crt):
        if not f.is_file():
            raise ValueError(f"--cert-path {d}: missing {f.name} (expects tls.crt and tls.key)")
    return key.read_bytes(), crt.read_bytes()


def key_and_cert(cert_path: str | None) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM): from --cert-path, else a new self-signed one."""
    return load_cert_dir(cert_path) if cert_path else self_signed()


def server_credentials(cert_path: str | None) -> tuple[grpc.ServerCredentials, bytes]:
    key, cert = key_and_cert(cert_path)
    return grpc.ssl_server_credentials([(key, cert)]), cert
