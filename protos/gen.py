"""Regenerate the committed protobuf/gRPC Python code: `python protos/gen.py` (`make protos`).

Sources live in protos/dsv4/v1/*.proto (proto package `dsv4.v1`); the generated modules are
committed under dsv4/rpc/v1/ and import as `dsv4.rpc.v1.router_pb2`. protoc runs with
`-Iprotos`, so its output imports `from dsv4.v1 import common_pb2`; we rewrite those module
paths to `dsv4.rpc.v1` (as TGI does with sed). Proto full names (`dsv4.v1.Router`) are untouched.

protoc runs in a subprocess: importing grpc_tools next to nixl crashes the interpreter.
`--out DIR` writes the modules into DIR instead (the staleness test compares the two).
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_PACKAGE_DIR = Path("dsv4") / "v1"
DEFAULT_OUT = REPO_ROOT / "dsv4" / "rpc" / "v1"

INIT_TEXT = '''"""Generated protobuf and gRPC modules of the `dsv4.v1` API.

Do not edit: run `python protos/gen.py` (`make protos`). Sources: protos/dsv4/v1/*.proto.
Only servicers and dsv4.wire touch these classes; everything else uses dsv4.types.
"""
'''

_FROM_IMPORT = re.compile(r"\bfrom dsv4\.v1 import\b")
_MODULE_NAME = re.compile(r"(['\"])dsv4\.v1\.(\w+_pb2)(['\"])")


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, in a stable order."""
    return sorted(
        p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto")
    )


def rewrite_module_paths(text: str) -> str:
    """Point generated imports and module names at dsv4.rpc.v1 instead of dsv4.v1."""
    text = _FROM_IMPORT.sub("from dsv4.rpc.v1 import", text)
    return _MODULE_NAME.sub(r"\1dsv4.rpc.v1.\2\3", text)


def run_protoc(work_dir: Path) -> Path:
    """Run grpc_tools.protoc in a subprocess; returns the folder holding the raw output."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={work_dir}",
        f"--pyi_out={work_dir}",
        f"--grpc_python_out={work_dir}",
        *[str(p) for p in proto_files()],
    ]
    result = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}")
    return work_dir / PROTO_PACKAGE_DIR


def generate(out_dir: Path) -> list[Path]:
    """Generate every module into out_dir (replacing old generated files); returns them."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for old in out_dir.glob("*_pb2*.py*"):
        old.unlink()
    written = []
    with tempfile.TemporaryDirectory(prefix="dsv4-protoc-") as tmp:
        raw_dir = run_protoc(Path(tmp))
        for src in sorted(raw_dir.iterdir()):
            dst = out_dir / src.name
            dst.write_text(rewrite_module_paths(src.read_text()))
            written.append(dst)
    init = out_dir / "__init__.py"
    init.write_text(INIT_TEXT)
    written.append(init)
    shutil.rmtree(out_dir / "__pycache__", ignore_errors=True)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
