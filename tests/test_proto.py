"""Generated code is never edited: regenerate from the .proto files and diff. The generators stamp their own
version into what they write (grpcio-tools: GRPC_GENERATED_VERSION; protoc: the gencode version and the runtime
check); a fresh install may bring a newer patch release of them, so the stamps are compared apart: what the
committed code requires must be what the installed runtime and pyproject's floors give."""

import os
import re
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
        with open(tmp_path / "steplens" / package / name) as a, open(os.path.join(committed_dir, name)) as b:
            assert _unstamped(a.read()) == _unstamped(b.read()), \
                f"{name} differs from what protoc generates: run `make proto`, never edit generated code"


STAMPS = (re.compile(r"^GRPC_GENERATED_VERSION = '[0-9.]+'$", re.M),
          re.compile(r"^# Protobuf Python Version: [0-9.]+$", re.M),
          re.compile(r"(ValidateProtobufRuntimeVersion\(\n\s+_runtime_version\.Domain\.PUBLIC,\n)\s+\d+,\n\s+\d+,\n"
                     r"\s+\d+,\n"))


def _unstamped(text: str) -> str:
    for rx in STAMPS:
        text = rx.sub(lambda m: (m.group(1) if m.groups() else "") + "<generator version>", text)
    return text


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("."))


def test_the_committed_code_runs_on_what_pyproject_installs():
    # the stamps of the committed code: the runtimes it refuses to run below
    import google.protobuf
    import grpc
    v1 = os.path.join(REPO, "proto", "steplens", "v1")
    grpc_stamps = set()
    pb_stamps = set()
    for name in os.listdir(v1):
        with open(os.path.join(v1, name)) as fh:
            text = fh.read() if name.endswith(".py") else ""
        grpc_stamps |= set(re.findall(r"^GRPC_GENERATED_VERSION = '([0-9.]+)'$", text, re.M))
        pb_stamps |= set(re.findall(r"^# Protobuf Python Version: ([0-9.]+)$", text, re.M))
    assert grpc_stamps and pb_stamps
    with open(os.path.join(REPO, "pyproject.toml")) as fh:
        project = fh.read()
    floor = {k: _version(v) for k, v in re.findall(r'"(grpcio|protobuf)>=([0-9.]+),', project)}
    for stamp in grpc_stamps:
        assert floor["grpcio"] >= _version(stamp) and _version(grpc.__version__) >= _version(stamp)
    for stamp in pb_stamps:
        assert floor["protobuf"] >= _version(stamp) and _version(google.protobuf.__version__) >= _version(stamp)


def test_schema_version_constant_matches_the_contract():
    from steplens import SCHEMA_VERSION
    from steplens.v1 import ingest_pb2
    assert SCHEMA_VERSION == ingest_pb2.SCHEMA_VERSION_CURRENT
