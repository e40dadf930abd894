"""Test certificates made with the openssl command line (no Python crypto package needed)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_certificates(folder: Path) -> dict[str, Path]:
    """A CA and one node certificate (server and client use, IP 127.0.0.1), plus a certificate
    from another CA, with the openssl command line."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    (folder / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n"
                                "extendedKeyUsage=serverAuth,clientAuth\n")
    for ca in ("ca", "other-ca"):
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem",
                "-days", "2", "-subj", f"/CN=pdserve test {ca}")
    for node, ca in (("node", "ca"), ("stranger", "other-ca")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{node}.key", "-out", f"{node}.csr",
                "-subj", f"/CN=pdserve {node}")
        openssl("x509", "-req", "-in", f"{node}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                "-CAcreateserial", "-out", f"{node}.pem", "-days", "2", "-extfile", "ext")
    return {name: folder / name
            for name in ("ca.pem", "node.pem", "node.key", "stranger.pem", "stranger.key")}
