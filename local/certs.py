"""Throw-away certificates for the local stack's TLS (components/gateway-tls, components/picker-tls):
a CA made at start, a certificate for the listeners (localhost, 127.0.0.1) and one for the picker
(its cluster Service name, which Envoy checks, and 127.0.0.1). Written into the run's folder,
valid one day; nothing outside the run trusts the CA."""
from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

PICKER_NAME = "inference-gateway-ext-proc.llm.svc.cluster.local"
LISTENER_NAMES = ("localhost",)
LOOPBACK = "127.0.0.1"
VALIDITY = datetime.timedelta(days=1)


@dataclass(frozen=True)
class RunCerts:
    """Files of one run: the CA, the listeners' and the picker's tls.crt/tls.key."""
    root: Path

    @property
    def ca(self) -> Path:
        return self.root / "ca.crt"

    @property
    def gateway(self) -> Path:
        return self.root / "gateway"

    @property
    def picker(self) -> Path:
        return self.root / "picker"


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _pem(cert) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def new_ca(common_name: str = "local-stack throw-away CA"):
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(_name(common_name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False,
                                         encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def issue(ca_key, ca_cert, dns_names: list[str], ips: list[str],
          usages: tuple = (ExtendedKeyUsageOID.SERVER_AUTH,)) -> tuple[bytes, bytes]:
    """(key PEM, certificate PEM) of a certificate signed by the CA, for `usages` (server by
    default; the first DNS name is its common name)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    sans = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    cert = (x509.CertificateBuilder().subject_name(_name(dns_names[0])).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .sign(ca_key, hashes.SHA256()))
    return _pem_key(key), _pem(cert)


def write_run_certs(root: Path) -> RunCerts:
    """A new CA and both server certificates under `root` (replacing any earlier run's)."""
    certs = RunCerts(Path(root))
    ca_key, ca_cert = new_ca()
    certs.root.mkdir(parents=True, exist_ok=True)
    certs.ca.write_bytes(_pem(ca_cert))
    for folder, names in ((certs.gateway, list(LISTENER_NAMES)), (certs.picker, [PICKER_NAME])):
        key, cert = issue(ca_key, ca_cert, names, [LOOPBACK])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tls.key").write_bytes(key)
        (folder / "tls.key").chmod(0o600)
        (folder / "tls.crt").write_bytes(cert)
    return certs


def _tls_secret(name: str, namespace: str | None, files: dict[str, bytes]) -> dict:
    meta = {"name": name, **({"namespace": namespace} if namespace else {})}
    return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls", "metadata": meta,
            "data": {k: base64.b64encode(v).decode() for k, v in files.items()}}


def secrets_for(gateway: list[dict], certs: RunCerts) -> list[dict]:
    """The Secrets the gateway objects name, filled from this run's files, as an operator creates
    them in a cluster (docs/deploy.md): each listener certificate of the Gateway (the listeners'
    tls.crt/tls.key) and each CA a Backend verifies its endpoints with (the picker's Secret:
    tls.crt, tls.key, ca.crt)."""
    ca = certs.ca.read_bytes()
    listener = {"tls.crt": (certs.gateway / "tls.crt").read_bytes(), "tls.key": (certs.gateway / "tls.key").read_bytes()}
    picker = {"tls.crt": (certs.picker / "tls.crt").read_bytes(), "tls.key": (certs.picker / "tls.key").read_bytes(),
              "ca.crt": ca}
    out: dict[tuple, dict] = {}
    for obj in gateway:
        namespace = (obj.get("metadata") or {}).get("namespace")
        if obj.get("kind") == "Gateway":
            for l in obj["spec"].get("listeners", []):
                for ref in (l.get("tls") or {}).get("certificateRefs") or []:
                    out[(namespace, ref["name"])] = _tls_secret(ref["name"], namespace, listener)
        elif obj.get("kind") == "Backend":
            for ref in ((obj["spec"].get("tls") or {}).get("caCertificateRefs")) or []:
                if ref.get("kind") == "Secret":
                    out[(namespace, ref["name"])] = _tls_secret(ref["name"], namespace, picker)
    return list(out.values())
