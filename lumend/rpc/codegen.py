"""Generates lumen_pb2.py, lumen_pb2_grpc.py and lumen_pb2.pyi from lumen.proto.

`make proto` (or `python -m lumend.rpc.codegen`) writes them beside the .proto file;
tests/rpc/test_proto_sync.py generates into a temporary directory and compares. The output
depends on the grpcio-tools version, which is pinned in pyproject's dev extra.
"""

from __future__ import annotations

from pathlib import Path

PROTO = "lumend/rpc/lumen.proto"
GENERATED = ("lumen_pb2.py", "lumen_pb2_grpc.py", "lumen_pb2.pyi")
REPO = Path(__file__).resolve().parents[2]


def generate(out_root: Path) -> list[Path]:
    """Write the generated modules under `out_root`/lumend/rpc/; returns their paths."""
    from grpc_tools import protoc  # a dev dependency: only regeneration needs it

    out_root.mkdir(parents=True, exist_ok=True)
    # The include root is the repository, so the generated imports read
    # `from lumend.rpc import lumen_pb2`, which works inside the package.
    args = ["grpc_tools.protoc", f"-I{REPO}", f"--python_out={out_root}",
            f"--grpc_python_out={out_root}", f"--pyi_out={out_root}", str(REPO / PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}; its messages are above")
    return [out_root / "lumend" / "rpc" / name for name in GENERATED]


def main() -> None:
    paths = generate(REPO)
    print("generated", ", ".join(str(p.relative_to(REPO)) for p in paths))


if __name__ == "__main__":
    main()
