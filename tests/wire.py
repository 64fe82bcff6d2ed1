"""A hand-driven Ingest client for tests: sends exactly the bytes or messages a test wants,
answers clock probes like a real agent, and collects what the collector says."""

from __future__ import annotations

import queue
import threading
import time
import uuid

import grpc

from steplens import SCHEMA_VERSION
from steplens.agent import records as r
from steplens.agent.transport.codec import encode_records
from steplens.v1 import ingest_pb2 as ipb

_STOP = object()


class RawAgent:
    def __init__(self, address: str, agent_id: str = "raw", spool_id: str | None = None,
                 channel: grpc.Channel | None = None, schema_version: int = SCHEMA_VERSION) -> None:
        self.channel = channel or grpc.insecure_channel(address, options=[
            ("grpc.max_send_message_length", 64 * 1024 * 1024)])
        self.agent_id = agent_id
        self.spool_id = spool_id or uuid.uuid4().hex
        self.schema_version = schema_version
        self.out: queue.Queue = queue.Queue()
        self.acks: list[ipb.Ack] = []
        self.hello_ack: ipb.HelloAck | None = None
        self.error: grpc.RpcError | None = None
        self.done = threading.Event()
        self._ack_cond = threading.Condition()
        call = self.channel.stream_stream("/steplens.v1.Ingest/Stream", request_serializer=None,
                                          response_deserializer=ipb.CollectorMessage.FromString)
        self.call = call(self._requests())
        threading.Thread(target=self._receive, daemon=True).start()

    def _requests(self):
        while True:
            item = self.out.get()
            if item is _STOP:
                return
            yield item if isinstance(item, bytes) else item.SerializeToString()

    def _receive(self) -> None:
        try:
            for msg in self.call:
                kind = msg.WhichOneof("msg")
                if kind == "probe":
                    now = time.monotonic_ns()
                    self.out.put(ipb.AgentMessage(clock=ipb.ClockReply(
                        probe_id=msg.probe.probe_id, t1_ns=msg.probe.t1_ns, t2_mono_ns=now, t3_mono_ns=now + 1000)))
                elif kind == "hello_ack":
                    self.hello_ack = msg.hello_ack
                elif kind == "ack":
                    with self._ack_cond:
                        self.acks.append(msg.ack)
                        self._ack_cond.notify_all()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.done.set()
            with self._ack_cond:
                self._ack_cond.notify_all()

    # -- helpers ---------------------------------------------------------------------------
    def send(self, item) -> None:
        self.out.put(item)

    def hello(self, timeout: float = 30.0, expect: bool = True) -> ipb.HelloAck | None:
        self.send(ipb.AgentMessage(hello=ipb.Hello(schema_version=self.schema_version, agent_id=self.agent_id,
                                                   spool_id=self.spool_id, hostname="test")))
        deadline = time.monotonic() + timeout
        while self.hello_ack is None and not self.done.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        if expect and self.hello_ack is None:
            err = self.error
            raise AssertionError(f"no HelloAck within {timeout}s: "
                                 f"{(err.code().name + ': ' + err.details()) if err else 'stream still open'}")
        return self.hello_ack

    def batch(self, seq: int, records: list, n_records: int | None = None, payload: bytes | None = None) -> None:
        payload = payload if payload is not None else encode_records([("test", x) for x in records])
        self.send(ipb.AgentMessage(batch=ipb.Batch(
            agent_id=self.agent_id, spool_id=self.spool_id, seq=seq,
            n_records=len(records) if n_records is None else n_records,
            sent_mono_ns=time.monotonic_ns(), payload=payload)))

    def wait_ack(self, seq: int, timeout: float = 30.0) -> ipb.Ack:
        deadline = time.monotonic() + timeout
        with self._ack_cond:
            while True:
                for a in self.acks:
                    if a.seq == seq:
                        return a
                if self.done.is_set() or time.monotonic() > deadline:
                    raise AssertionError(f"no ack for seq {seq}; error: {self.error and self.error.details()}")
                self._ack_cond.wait(0.1)

    def wait_error(self, timeout: float = 10.0) -> grpc.RpcError:
        assert self.done.wait(timeout), "stream did not end"
        assert self.error is not None, "stream ended without an error"
        return self.error

    def close(self) -> None:
        self.out.put(_STOP)
        self.done.wait(5)
        self.channel.close()


def metrics(n: int, name: str = "m", start_ns: int | None = None, step_ns: int = 1000) -> list:
    t = start_ns or time.monotonic_ns() - n * step_ns
    return [r.Metric(t + i * step_ns, name, "e", float(i)) for i in range(n)]
