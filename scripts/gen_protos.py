"""Regenerate the committed gRPC/protobuf stubs in fp8rl/v1 from protos/fp8rl/v1/*.proto.

Usage: python scripts/gen_protos.py [--out DIR]   (DIR defaults to the repository root; the drift test
generates into a temporary directory and compares).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def generate(out: Path) -> list[Path]:
    sources = sorted(PROTO_ROOT.glob("fp8rl/v1/*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in sources],
    ]
    include = Path(protoc.__file__).parent / "_proto"
    args.insert(1, f"-I{include}")
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "fp8rl" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT)
    out = parser.parse_args().out
    (out / "fp8rl" / "v1").mkdir(parents=True, exist_ok=True)
    for path in generate(out):
        print(path.relative_to(out), file=sys.stderr)


if __name__ == "__main__":
    main()
