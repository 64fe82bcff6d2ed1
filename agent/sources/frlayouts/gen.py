"""Writes the Flight Recorder memory layout of the torch installed beside this Python (frmemory's input):
compiles a small C++ program against that torch's own headers, which prints the offsets of
c10d::FlightRecorder<c10::Event> and its Entry, of ProcessGroupStatus, of libstdc++'s red-black tree nodes, and
torch's ScalarType names, and saves them as torch-<major>.<minor>.json in this directory.

    .venv/bin/python -m steplens.agent.sources.frlayouts.gen [--out DIR]

Needs g++ and a torch wheel with its headers (every wheel ships them). The layout is of the C++ ABI this torch
was built with (libstdc++, the new string ABI: torch._C._GLIBCXX_USE_CXX11_ABI); frmemory refuses a torch whose
version has no file here, and checks what it reads against the rules the code keeps (slots, ids, sizes)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

SOURCE = r"""
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <map>
#include <c10/core/Event.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
using FR = c10d::FlightRecorder<c10::Event>;
using E = FR::Entry;
using S = c10d::ProcessGroupStatus;
static char buf[8192] __attribute__((aligned(64)));
#define OFF(T, f) (long)((char*)&(((T*)buf)->f) - buf)
int main() {
  E* e = (E*)buf;
  std::map<size_t, int> m;
  m[7] = 1;
  char* node = (char*)&*m.begin() - sizeof(std::_Rb_tree_node_base);
  long root = -1;
  for (long i = 0; i + 8 <= (long)sizeof(m); i += 8) {
    char* p;
    memcpy(&p, (char*)&m + i, 8);
    if (p == node) { root = i; break; }
  }
  printf("{\"abi_cxx11\": %d,\n", (int)_GLIBCXX_USE_CXX11_ABI);
  printf("\"entry_size\": %zu, \"recorder_size\": %zu, \"version\": \"%s\",\n", sizeof(E), sizeof(FR),
         c10d::version_val_str.c_str());
  printf("\"entry\": {\"id\": %ld, \"reset_epoch\": %ld, \"pg_id\": %ld, \"pg_name\": %ld, \"pg_desc\": %ld,\n",
    OFF(E, id_), OFF(E, reset_epoch_), OFF(E, pg_id_),
    (long)((char*)&std::get<0>(e->pg_name_) - buf), (long)((char*)&std::get<1>(e->pg_name_) - buf));
  printf("\"collective_seq_id\": %ld, \"p2p_seq_id\": %ld, \"op_id\": %ld, \"profiling_name\": %ld,\n",
    OFF(E, collective_seq_id_), OFF(E, p2p_seq_id_), OFF(E, op_id_), OFF(E, profiling_name_));
  printf("\"time_created\": %ld, \"timeout_ms\": %ld, \"is_p2p\": %ld, \"duration\": %ld, "
         "\"time_discovered_started\": %ld, \"time_discovered_completed\": %ld,\n",
    OFF(E, time_created_), OFF(E, timeout_ms_), OFF(E, isP2P_), OFF(E, duration_),
    OFF(E, time_discovered_started_), OFF(E, time_discovered_completed_));
  printf("\"input_dims\": %ld, \"input_dtypes\": %ld, \"output_dims\": %ld, \"output_dtypes\": %ld, \"sizes\": %ld, "
         "\"retired\": %ld},\n",
    OFF(E, input_dims_), OFF(E, input_dtypes_), OFF(E, output_dims_), OFF(E, output_dtypes_), OFF(E, sizes_),
    OFF(E, retired_));
  printf("\"recorder\": {\"enabled\": %ld, \"entries\": %ld, \"max_entries\": %ld, \"next\": %ld, \"id\": %ld, "
         "\"reset_epoch\": %ld, \"all_pg_status\": %ld, \"pg_name_to_ranks\": %ld},\n",
    OFF(FR, enabled_), OFF(FR, entries_), OFF(FR, max_entries_), OFF(FR, next_), OFF(FR, id_), OFF(FR, reset_epoch_),
    OFF(FR, all_pg_status_), OFF(FR, pg_name_to_ranks_));
  printf("\"sizes\": {\"string\": %zu, \"string_local\": %ld, \"optional_float\": %zu, \"optional_time\": %zu, "
         "\"smallvec4\": %zu, \"smallvec8\": %zu, \"vector\": %zu, \"scalar_type\": %zu, \"tuple2\": %zu},\n",
    sizeof(std::string), (long)(15), sizeof(std::optional<float>), sizeof(std::optional<c10::time_t>),
    sizeof(c10::SmallVector<int64_t, 4>), sizeof(c10::SmallVector<int64_t, 8>), sizeof(std::vector<c10::ScalarType>),
    sizeof(c10::ScalarType), sizeof(std::tuple<std::string, std::string>));
  printf("\"map\": {\"root\": %ld, \"node_left\": %zu, \"node_right\": %zu, \"node_value\": %zu},\n", root,
    offsetof(std::_Rb_tree_node_base, _M_left), offsetof(std::_Rb_tree_node_base, _M_right),
    sizeof(std::_Rb_tree_node_base));
  printf("\"pg_status\": {\"last_enqueued\": %ld, \"last_started\": %ld, \"last_completed\": %ld},\n",
    OFF(S, lastEnqueuedSeq), OFF(S, lastStartedSeq), OFF(S, lastCompletedSeq));
  printf("\"scalar_types\": [");
  for (int i = 0; i < (int)c10::ScalarType::NumOptions; i++)
    printf("%s\"%s\"", i ? ", " : "", c10::toString((c10::ScalarType)i));
  printf("]}\n");
}
"""


def generate(out_dir: str) -> str:
    import torch
    base = os.path.dirname(torch.__file__)
    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "layout.cpp"), os.path.join(tmp, "layout")
        with open(src, "w") as fh:
            fh.write(SOURCE)
        lib = os.path.join(base, "lib")
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        inc = os.path.join(base, "include")
        subprocess.run(["g++", "-std=c++17", "-O0", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I", inc,
                        "-I", os.path.join(inc, "torch", "csrc", "api", "include"), src, "-o", exe,
                        "-L", lib, "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}"], check=True)
        layout = json.loads(subprocess.run([exe], check=True, capture_output=True, text=True).stdout)
    layout["torch"] = torch.__version__
    layout["machine"] = os.uname().machine
    path = os.path.join(out_dir, f"torch-{major_minor}.json")
    with open(path, "w") as fh:
        json.dump(layout, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    args = ap.parse_args(argv)
    print(generate(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
