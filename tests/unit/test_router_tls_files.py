"""`dsv4 router --tls-cert/--tls-key/--tls-ca`: files that are not a PEM certificate / key, or a
key that is not the certificate's, end in one line naming the flag with exit 2, before the port
is bound (gRPC's C core used to fail the bind: "cannot listen ... pick a free port", exit 1)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dsv4.config.load import load_config
from dsv4.errors import ConfigError
from router_svc.server import check_tls_files, main

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")


def _self_signed(folder: Path, name: str) -> tuple[Path, Path]:
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
         "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder, "a")
    other_cert, other_key = _self_signed(folder, "b")
    garbage = folder / "garbage.pem"
    garbage.write_text("not pem at all\n")
    bad_key = folder / "bad.key"
    bad_key.write_text("-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n")
    bad_cert = folder / "bad.crt"
    bad_cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    encrypted = folder / "enc.key"
    subprocess.run(
        ["openssl", "pkey", "-in", str(key), "-aes256", "-passout", "pass:pw", "-out",
         str(encrypted)],
        check=True, capture_output=True, timeout=30,
    )  # fmt: skip
    return {"cert": cert, "key": key, "other_key": other_key, "garbage": garbage,
            "bad_key": bad_key, "bad_cert": bad_cert, "encrypted": encrypted,
            "missing": folder / "missing.pem", "other_cert": other_cert}  # fmt: skip


# (--tls-cert, --tls-key, extra flags, the flag named, what the line says)
CASES = {
    "garbage cert": ("garbage", "key", (), "--tls-cert", "not a PEM certificate"),
    "cert that does not parse": ("bad_cert", "key", (), "--tls-cert", "does not parse"),
    "key as cert": ("key", "cert", (), "--tls-cert", "not a PEM certificate"),
    "garbage key": ("cert", "garbage", (), "--tls-key", "not a PEM private key"),
    "key that does not parse": ("cert", "bad_key", (), "--tls-key", "does not parse"),
    "key of another cert": ("cert", "other_key", (), "--tls-key", "does not match"),
    "encrypted key": ("cert", "encrypted", (), "--tls-key", "encrypted key"),
    "missing key": ("cert", "missing", (), "--tls-key", "no such file"),
    "garbage CA and key": ("cert", "garbage", ("--tls-ca", "garbage"), "--tls-ca", "not a PEM"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_tls_files_exit_2_naming_the_flag(case, files, monkeypatch, capsys):
    cert, key, extra, flag, says = case
    monkeypatch.setenv("DSV4_SHARED_SECRET", "tls-files-test-secret-0123456789abcdef")
    extra = [files.get(x, x) for x in extra]
    argv = ["--tls-cert", files[cert], "--tls-key", files[key], *extra, "--port", "0"]
    with pytest.raises(SystemExit) as exc:
        main([str(a) for a in argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dsv4 router: {flag} ") and err.count("\n") == 1, err
    assert says.lower() in err.lower() and "free port" not in err


def _settings(files: dict[str, Path], ca: str) -> dict[str, str]:
    return {"security.tls_cert_path": str(files["cert"]),
            "security.tls_key_path": str(files["key"]),
            "security.tls_ca_path": str(files[ca])}  # fmt: skip


def test_a_matching_pair_and_ca_pass(files):
    check_tls_files(load_config(_settings(files, "other_cert")))


def test_a_bad_ca_with_a_good_pair_names_tls_ca(files):
    """In-process, not through main: with the pair good, a regression would serve forever."""
    with pytest.raises(ConfigError, match=r"^--tls-ca .*does not parse"):
        check_tls_files(load_config(_settings(files, "bad_cert")))
