"""The checked-in gRPC modules are what `make proto` generates from lumen.proto now."""

from __future__ import annotations

from pathlib import Path

from lumend.rpc.codegen import GENERATED, REPO, generate


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    for fresh in generate(tmp_path):
        checked_in = REPO / "lumend" / "rpc" / fresh.name
        assert checked_in.read_text() == fresh.read_text(), (
            f"{checked_in.relative_to(REPO)} is out of date with lumend/rpc/lumen.proto; "
            "run `make proto` and commit the result")
    assert {p.name for p in (REPO / "lumend" / "rpc").glob("lumen_pb2*")} == set(GENERATED)


def test_the_negative_control_a_changed_proto_is_caught(tmp_path: Path) -> None:
    # The comparison above must notice an edit: the same generator with one more field
    # writes a different module.
    proto = (REPO / "lumend/rpc/lumen.proto").read_text()
    edited = tmp_path / "lumend" / "rpc" / "lumen.proto"
    edited.parent.mkdir(parents=True)
    changed = proto.replace("message ProgressReply {\n",
                            "message ProgressReply {\n  bool extra = 9;\n", 1)
    assert changed != proto
    edited.write_text(changed)
    from grpc_tools import protoc

    out = tmp_path / "out"
    out.mkdir()
    assert protoc.main(["protoc", f"-I{tmp_path}", f"--python_out={out}",
                        str(edited)]) == 0
    assert ((out / "lumend/rpc/lumen_pb2.py").read_text()
            != (REPO / "lumend/rpc/lumen_pb2.py").read_text())


def test_generated_modules_load_with_the_installed_runtime() -> None:
    from google.protobuf import __version__ as protobuf_version

    from lumend.rpc import lumen_pb2, lumen_pb2_grpc

    assert int(protobuf_version.split(".")[0]) >= 7
    reply = lumen_pb2.AdmitReply(epoch=7, admitted=True)
    assert lumen_pb2.AdmitReply.FromString(reply.SerializeToString()).epoch == 7
    assert hasattr(lumen_pb2_grpc, "CoordinatorStub") and hasattr(lumen_pb2_grpc, "AgentStub")
