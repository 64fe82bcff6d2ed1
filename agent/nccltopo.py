"""NCCL topology: which host, process and GPU is each rank of each communicator (comm hash -> rank -> place),
from NCCL_DEBUG=INFO logs and from NCCL RAS.

Reads (1) log files written with `NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,COLL NCCL_DEBUG_FILE=dir/nccl.%h.%p.log`
(`steplens-agent env` prints these): the per-rank "Init COMPLETE" (or "Init START") line

    host:pid:tid [cudaDev] NCCL INFO [ncclCommInitRank[Config] ]comm 0x<ptr> rank R nranks N cudaDev D
        [nvmlDev V] busId B [commId 0x<hash>] [more fields] - Init COMPLETE

(commId appears from NCCL 2.1x on; older logs have no hash, and then the comm pointer stands in, per
process); and (2) NCCL RAS (NCCL >= 2.24, TCP localhost:28028, `NCCL_RAS_ADDR` to move it) in JSON format
(SET FORMAT json, NCCL >= 2.28.7): communicators[].hash and ranks[].{rank, host, pid, cuda_dev, nvml_dev}.
The RAS client speaks the line protocol of NCCL's own `ncclras` (src/ras/client.cc): "CLIENT PROTOCOL 2",
"TIMEOUT n", "SET FORMAT json", "VERBOSE STATUS", then reads to EOF. Pure parsing functions; the one
network function degrades to RasUnavailable with a reason.

Comm hashes are normalized to lowercase hex without 0x and leading zeros (`norm_hash`), the form
CommOp.comm_id uses for NCCL communicators.
Cost: a log scan is a regex per line over files read once (offsets kept by the caller); a RAS query makes
NCCL run a collective among its RAS threads (~ms to seconds at scale), so poll it rarely.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, field

RAS_PORT = 28028
RAS_PROTOCOL = 2

_LINE = re.compile(
    r"^(?:\S+:\s+)?(?P<host>[^\s:]+):(?P<pid>\d+):(?P<tid>\d+)\s+\[(?P<dev>\d+)\]\s+NCCL INFO\s+"
    r"(?:\S+\s+)?comm\s+(?P<comm>0x[0-9a-fA-F]+)\s+rank\s+(?P<rank>\d+)\s+nranks\s+(?P<nranks>\d+)"
    r"\s+cudaDev\s+(?P<cudaDev>\d+)(?:\s+nvmlDev\s+(?P<nvmlDev>\d+))?\s+busId\s+(?P<busId>[0-9a-fA-F]+)"
    r"(?:\s+commId\s+(?P<commId>0x[0-9a-fA-F]+))?.*?-\s+Init\s+(?P<phase>COMPLETE|START)\s*$")


def norm_hash(h: str | int) -> str:
    """'0x5AE77EB5EA4EC1EE' / 0x5ae7... -> '5ae77eb5ea4ec1ee'."""
    v = h if isinstance(h, int) else int(str(h), 16)
    return format(v, "x")


def norm_bus_id(b: str) -> str:
    """NCCL's short busId ('9b000') -> the PCI form nvidia-smi prints ('00000000:9B:00.0')."""
    v = int(b, 16)
    # NCCL packs the hex digits of "dddd:bb:dd.f" into one integer (busIdToInt64), so one nibble of function
    domain, bus, dev, fn = v >> 20, (v >> 12) & 0xFF, (v >> 4) & 0xFF, v & 0xF
    return f"{domain:08X}:{bus:02X}:{dev:02X}.{fn:X}"


@dataclass
class RankPlace:
    rank: int
    host: str
    pid: int
    cuda_dev: int = -1
    nvml_dev: int = -1
    bus_id: str = ""           # NCCL's short form, e.g. "9b000"
    comm_ptr: str = ""


@dataclass
class Communicator:
    comm_hash: str             # norm_hash form, or "ptr:<host>:<pid>:<0x..>" when the log has no commId
    nranks: int
    ranks: dict = field(default_factory=dict)   # rank -> RankPlace
    complete: bool = False     # an Init COMPLETE line (not only START) was seen for some rank


def parse_init_line(line: str) -> dict | None:
    """One NCCL log line -> its init fields, or None when it is not an Init START/COMPLETE line."""
    m = _LINE.match(line.strip())
    if not m:
        return None
    g = m.groupdict()
    return {"host": g["host"], "pid": int(g["pid"]), "tid": int(g["tid"]), "comm_ptr": g["comm"].lower(),
            "rank": int(g["rank"]), "nranks": int(g["nranks"]), "cuda_dev": int(g["cudaDev"]),
            "nvml_dev": int(g["nvmlDev"]) if g["nvmlDev"] is not None else -1, "bus_id": g["busId"].lower(),
            "comm_hash": norm_hash(g["commId"]) if g["commId"] else "", "phase": g["phase"]}


def parse_log(lines, comms: dict[str, Communicator] | None = None) -> dict[str, Communicator]:
    """NCCL log lines (any iterable of str) -> {comm hash: Communicator}; merges into `comms`."""
    comms = {} if comms is None else comms
    for line in lines:
        if "Init " not in line:
            continue
        f = parse_init_line(line)
        if f is None:
            continue
        key = f["comm_hash"] or f"ptr:{f['host']}:{f['pid']}:{f['comm_ptr']}"
        c = comms.get(key)
        if c is None:
            c = comms[key] = Communicator(key, f["nranks"])
        c.ranks[f["rank"]] = RankPlace(f["rank"], f["host"], f["pid"], f["cuda_dev"], f["nvml_dev"], f["bus_id"],
                                       f["comm_ptr"])
        c.complete = c.complete or f["phase"] == "COMPLETE"
    return comms


def parse_log_files(paths, comms: dict[str, Communicator] | None = None) -> dict[str, Communicator]:
    comms = {} if comms is None else comms
    for p in paths:
        try:
            with open(p, encoding="utf-8", errors="replace") as fh:
                parse_log(fh, comms)
        except OSError:
            continue
    return comms


def log_files(directory: str) -> list[str]:
    """The NCCL_DEBUG_FILE logs in `directory` (nccl.<host>.<pid>.log, the pattern `env` prints)."""
    try:
        return sorted(os.path.join(directory, n) for n in os.listdir(directory)
                      if n.startswith("nccl.") and n.endswith(".log"))
    except OSError:
        return []


# ---- NCCL RAS ----------------------------------------------------------------------------------------

class RasUnavailable(Exception):
    """RAS could not be queried here (nothing listening, old NCCL without JSON, timeout); str() says why."""


def parse_ras_json(doc: str | dict) -> dict[str, Communicator]:
    """RAS `SET FORMAT json` + `STATUS` output -> {comm hash: Communicator} (RAS has no busId: bus_id "")."""
    if isinstance(doc, str):
        try:
            doc = json.loads(doc)
        except ValueError as exc:
            raise RasUnavailable(f"RAS answer is not JSON ({exc}); NCCL older than 2.28.7 answers text only") from None
    comms: dict[str, Communicator] = {}
    for c in doc.get("communicators", []) or []:
        try:
            h = norm_hash(c["hash"])
        except (KeyError, ValueError, TypeError):
            continue
        comm = comms[h] = Communicator(h, int(c.get("size", 0)), complete=True)
        for r in list(c.get("ranks", []) or []) + list(c.get("missing_ranks", []) or []):
            try:
                comm.ranks[int(r["rank"])] = RankPlace(int(r["rank"]), str(r.get("host", "")), int(r.get("pid", -1)),
                                                       int(r.get("cuda_dev", -1)), int(r.get("nvml_dev", -1)))
            except (KeyError, ValueError, TypeError):
                continue
    return comms


def ras_query(host: str = "localhost", port: int = RAS_PORT, timeout_s: float = 5.0, verbose: bool = True,
              collective_timeout_s: int | None = None) -> str:
    """The raw JSON text of a RAS STATUS query. Raises RasUnavailable (never anything else) when RAS
    cannot answer: nothing listening, a handshake that is not RAS, a format the server refuses."""
    try:
        s = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise RasUnavailable(f"NCCL RAS not reachable at {host}:{port}: {exc}") from None
    try:
        f = s.makefile("rwb")

        def cmd(text: str) -> str:
            f.write(text.encode() + b"\n")
            f.flush()
            return f.readline().decode("utf-8", "replace").strip()

        hello = cmd(f"CLIENT PROTOCOL {RAS_PROTOCOL}")
        if not hello.upper().startswith("SERVER PROTOCOL"):
            raise RasUnavailable(f"{host}:{port} is not NCCL RAS (answered {hello[:60]!r})")
        if collective_timeout_s is not None:
            if cmd(f"TIMEOUT {int(collective_timeout_s)}").upper() != "OK":
                raise RasUnavailable("RAS refused TIMEOUT")
        ok = cmd("SET FORMAT json")
        if ok.upper() != "OK":
            raise RasUnavailable(f"RAS refused JSON output ({ok[:60]!r}); needs NCCL >= 2.28.7")
        f.write(b"VERBOSE STATUS\n" if verbose else b"STATUS\n")
        f.flush()
        return f.read().decode("utf-8", "replace")
    except (OSError, socket.timeout) as exc:
        raise RasUnavailable(f"NCCL RAS at {host}:{port}: {exc}") from None
    finally:
        s.close()


def ras_topology(host: str = "localhost", port: int = RAS_PORT, timeout_s: float = 5.0) -> dict[str, Communicator]:
    return parse_ras_json(ras_query(host, port, timeout_s))


def merge(*sources: dict[str, Communicator]) -> dict[str, Communicator]:
    """Later sources fill what earlier ones lack (RAS gives pids of other hosts; logs give busIds)."""
    out: dict[str, Communicator] = {}
    for comms in sources:
        for h, c in comms.items():
            m = out.setdefault(h, Communicator(h, c.nranks))
            m.nranks = m.nranks or c.nranks
            m.complete = m.complete or c.complete
            for r, p in c.ranks.items():
                old = m.ranks.get(r)
                if old is None:
                    m.ranks[r] = RankPlace(**vars(p))
                    continue
                for k, v in vars(p).items():
                    if getattr(old, k) in ("", -1) and v not in ("", -1):
                        setattr(old, k, v)
    return out
