"""Records: the plain dataclasses every agent source emits.

Sources never see protobuf or gRPC; agent/transport/codec.py encodes these, and the collector's
ingest decodes them. Every record carries mono_ns, this host's CLOCK_MONOTONIC at observation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class Mode(IntEnum):
    SENTINEL = 1
    DEEP = 2


@dataclass(slots=True)
class Metric:
    """One sample. Names carry units (`_bytes`, `_seconds`, `_percent`) and `_total` for counters."""

    mono_ns: int
    name: str
    entity: str
    value: float


@dataclass(slots=True)
class GpuInfo:
    mono_ns: int
    index: int
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    memory_total_bytes: int = 0
    driver_version: str = ""
    cuda_driver_version: str = ""
    nvlink_count: int = 0
    serial: str = ""


@dataclass(slots=True)
class ProcessInfo:
    mono_ns: int
    pid: int
    start_ticks: int
    ppid: int = 0
    exe: str = ""
    cmdline: list[str] = field(default_factory=list)
    framework: str = ""
    job_key: str = ""
    rank: int = -1
    local_rank: int = -1
    world_size: int = -1
    master_addr: str = ""
    master_port: int = 0
    env: dict[str, str] = field(default_factory=dict)
    container_id: str = ""
    uid: int = 0


@dataclass(slots=True)
class ProcessExit:
    mono_ns: int
    pid: int
    start_ticks: int


@dataclass(slots=True)
class Event:
    mono_ns: int
    kind: str
    entity: str = ""
    message: str = ""
    value: float = 0.0


@dataclass(slots=True)
class Gap:
    mono_ns: int
    dropped_records: int
    dropped_batches: int
    first_seq: int
    last_seq: int
    reason: str = ""


@dataclass(slots=True)
class ModeChange:
    mono_ns: int
    mode: Mode
    command_id: str = ""
    until_mono_ns: int = 0
    reason: str = ""


@dataclass(slots=True)
class StackSummary:
    """Python stacks of one thread over [start_mono_ns, mono_ns]: frames interned, stacks counted."""

    mono_ns: int
    pid: int
    start_ticks: int
    tid: int
    thread_name: str
    start_mono_ns: int
    samples: int
    # (function, qualname, file, line) per frame id
    frames: list[tuple[str, str, str, int]] = field(default_factory=list)
    # (frame ids innermost first, count, gil, running)
    stacks: list[tuple[tuple[int, ...], int, int, int]] = field(default_factory=list)
    errors: int = 0
    python: str = ""
    last_state: str = ""


@dataclass(slots=True)
class ConnStats:
    """One TCP connection's traffic on this host over [start_mono_ns, mono_ns] (deltas, not totals).

    Addresses as seen on this host: src/sport local, dst/dport remote. Wire bytes are skb lengths
    at the device (what interface counters count); payload bytes are what the sockets sent/received.
    """

    mono_ns: int
    start_mono_ns: int
    src: str
    sport: int
    dst: str
    dport: int
    tx_bytes: int = 0
    rx_bytes: int = 0
    tx_packets: int = 0
    rx_packets: int = 0
    tx_payload_bytes: int = 0
    rx_payload_bytes: int = 0
    retransmits: int = 0
    srtt_us: int = 0
    pid: int = 0
    comm: str = ""
    net_limited_us: int = 0   # time with data to send held back by the network (tcpinfo; 0: unknown)


@dataclass(slots=True)
class Flow:
    """A flow as LLMPrism uses them: one burst of one connection's traffic in one direction,
    separated from the next by at least the configured idle gap (times are this host's monotonic)."""

    mono_ns: int          # burst end (last packet)
    start_mono_ns: int    # burst start (first packet)
    src: str
    sport: int
    dst: str
    dport: int
    bytes: int
    packets: int
    pid: int = 0


@dataclass(slots=True)
class CommOp:
    """One communication operator as one rank saw it; field meanings as in records.proto CommOp.
    mono_ns is end_mono_ns, or the issue time when the source has no end. Times: this host's monotonic."""

    mono_ns: int
    timing: str                 # gpu_kernel | cuda_event | backend_thread | cpu_enqueue
    pid: int
    comm_id: str                # NCCL comm hash (hex) or "pg:<name>"
    op: str                     # normalized: all_reduce, broadcast, send, recv, barrier, ...
    start_ticks: int = 0
    tid: int = 0
    device: int = -1
    comm_desc: str = ""
    rank: int = -1
    group_rank: int = -1
    nranks: int = 0
    members: list = field(default_factory=list)
    peer: int = -1
    root: int = -1
    count: int = 0
    dtype: str = ""
    bytes: int = 0
    seq: int = -1
    p2p_seq: int = -1
    stream: int = 0
    issue_mono_ns: int = 0
    start_mono_ns: int = 0
    end_mono_ns: int = 0
    job_key: str = ""
    seq_source: str = ""        # trace | order (numbered by the parser in issue order) | "" (seq unknown)


@dataclass(slots=True)
class KernelRec:
    """One GPU kernel (or CPU operator span) with its launch API call; mono_ns is end_mono_ns."""

    mono_ns: int
    pid: int
    name: str
    start_mono_ns: int
    end_mono_ns: int
    start_ticks: int = 0
    tid: int = 0
    device: int = -1
    stream: int = 0
    grid: list = field(default_factory=list)
    block: list = field(default_factory=list)
    correlation_id: int = 0
    launch_api: str = ""
    launch_start_mono_ns: int = 0
    launch_end_mono_ns: int = 0
    graph_id: int = 0
    rank: int = -1


@dataclass(slots=True)
class CommSummary:
    """Per-step (step >= 0) or per-interval (step = -1) summary of one process's ops of one kind on one
    communicator: what goes upstream while the CommOp stream stays on the node. mono_ns: last op end."""

    mono_ns: int
    pid: int
    comm_id: str
    op: str
    start_mono_ns: int
    calls: int
    bytes: int
    busy_ns: int
    max_ns: int
    start_ticks: int = 0
    job_key: str = ""
    rank: int = -1
    step: int = -1
    seq_first: int = -1
    seq_last: int = -1
    timing: str = ""
    issue_latency_ns_sum: int = 0
    kernels: int = 0


@dataclass(slots=True)
class CommMember:
    """One rank of one NCCL communicator and where it runs (comm hash -> rank -> host/pid/GPU)."""

    mono_ns: int
    comm_id: str
    rank: int
    nranks: int
    host: str
    pid: int
    cuda_dev: int = -1
    nvml_dev: int = -1
    bus_id: str = ""
    global_rank: int = -1
    job_key: str = ""
    via: str = "nccl_log"


@dataclass(slots=True)
class StepComm:
    """One communicator's ops within one Step (records.proto StepComm)."""

    comm_id: str
    op: str                     # the op kind, or "mixed"
    calls: int
    bytes: int
    busy_ns: int                # sum of op durations where the source has start and end
    wait_ns: int                # sum of (start - issue) where the source measured both; -1 unknown
    seq_first: int              # sequence number of the first op, -1 unknown
    issue_offsets_ns: list = field(default_factory=list)  # each op's issue time - step start, issue order
    offsets_dropped: int = 0    # ops past the per-step cap, not in issue_offsets_ns


@dataclass(slots=True)
class Step:
    """One training step of one process, segmented on the agent (agent/steps.py). mono_ns = end_mono_ns."""

    mono_ns: int
    pid: int
    start_ticks: int
    job_key: str
    rank: int
    step: int
    start_mono_ns: int
    end_mono_ns: int
    evidence: str               # profiler | comm_pattern | anchor
    period_ops: int             # ops per cycle of the learnt pattern (0 for profiler steps)
    ops: int                    # ops in this step
    comms: list = field(default_factory=list)  # StepComm


@dataclass(slots=True)
class Iteration:
    """One iteration of a process, bounded exactly by an iteration anchor in the job (a serving engine's step, a
    training step function: agent/bootstrap/site/steplens_iters.py), with the workload it carried as the anchor's
    feature reader saw it (records.proto Iteration). mono_ns = end_mono_ns. Counts a reader could not see are 0."""

    mono_ns: int
    pid: int
    start_ticks: int
    job_key: str
    rank: int
    seq: int                    # the process's own iteration counter (the ring's anchor number)
    start_mono_ns: int
    end_mono_ns: int
    anchor: str                 # "module:Qualname" of the anchor function
    phase: str                  # prefill | decode | mixed | train | "" (no feature reader)
    batch_size: int = 0         # requests (inference) or samples (training) in the iteration
    prefill_requests: int = 0   # requests processing prompt tokens (a chunk of prefill counts)
    prefill_tokens: int = 0     # prompt tokens computed in the iteration
    decode_requests: int = 0    # requests generating one token
    kv_tokens: int = 0          # context (KV cache) tokens the decode requests attend to
    input_tokens: int = 0       # sum of the batch's prompt lengths
    output_tokens: int = 0      # sum of the batch's generated lengths so far
    tokens: int = 0             # tokens the iteration processed (scheduled tokens; a training step's tokens)
    micro_batches: int = 0      # training: forward passes in the step where seen


@dataclass(slots=True)
class CommProgress:
    """Where one process stands on one communicator, as of mono_ns (when the state was read): the collective
    sequence numbers it has enqueued, started and completed (torch Flight Recorder pg_status; -1 none), and
    the oldest op it enqueued that has not completed (what it waits in during a hang). What a hang's culprit
    is found from: the member that never entered the sequence number the others wait in."""

    mono_ns: int
    pid: int
    comm_id: str                # as CommOp.comm_id ("pg:<name>" from the Flight Recorder)
    start_ticks: int = 0
    job_key: str = ""
    rank: int = -1              # the process's global rank
    last_enqueued: int = -1     # collective seq numbers; -1 none
    last_started: int = -1
    last_completed: int = -1
    pending_op: str = ""        # the oldest op enqueued and not completed (normalized op kind); "" none
    pending_seq: int = -1       # its collective seq (p2p: its p2p seq)
    pending_p2p: bool = False   # the pending op is a send/recv (pending_seq is a p2p seq)
    pending_peer: int = -1      # p2p: the peer's global rank where known, else -1
    pending_since_mono_ns: int = 0  # its issue time (this host's monotonic clock); 0 none
    nranks: int = 0             # members of the communicator where known


Record = (Metric | GpuInfo | ProcessInfo | ProcessExit | Event | Gap | ModeChange | StackSummary | ConnStats
          | Flow | CommOp | KernelRec | CommSummary | CommMember | Step | CommProgress)
