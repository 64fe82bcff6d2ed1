"""Generated code is never edited: regenerate from the .proto files and diff."""

import filecmp
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO


@pytest.mark.parametrize("package, grpc", [("v1", True), ("perfetto", False)])
def test_generated_code_matches_protos(tmp_path, package, grpc):
    shutil.copytree(os.path.join(REPO, "proto", "steplens"), tmp_path / "steplens",
                    ignore=shutil.ignore_patterns("*_pb2*.py", "*_pb2.pyi", "__pycache__"))
    protos = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "steplens" / package).glob("*.proto"))
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", str(tmp_path), f"--python_out={tmp_path}",
                    f"--pyi_out={tmp_path}", *([f"--grpc_python_out={tmp_path}"] if grpc else []), *protos],
                   check=True, cwd=tmp_path)
    generated = sorted(p.name for p in (tmp_path / "steplens" / package).iterdir()
                       if p.name.endswith((".py", ".pyi")) and "_pb2" in p.name)
    committed_dir = os.path.join(REPO, "proto", "steplens", package)
    committed = sorted(n for n in os.listdir(committed_dir) if "_pb2" in n and n.endswith((".py", ".pyi")))
    assert generated == committed
    for name in generated:
        assert filecmp.cmp(tmp_path / "steplens" / package / name, os.path.join(committed_dir, name),
                           shallow=False), f"{name} differs from what protoc generates: run `make proto`, never edit " \
                                           "generated code"


def test_schema_version_constant_matches_the_contract():
    from steplens import SCHEMA_VERSION
    from steplens.v1 import ingest_pb2
    assert SCHEMA_VERSION == ingest_pb2.SCHEMA_VERSION_CURRENT
