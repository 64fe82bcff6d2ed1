"""The simulator's streaming mode with light emulated agents (bench/sim/lightagent.py) against a real
collector on loopback: every agent connects, and every record sent is stored exactly once."""

import sys

from conftest import REPO, CollectorProc, wait_for

sys.path.insert(0, REPO)

from bench.sim.faults import parse_fault  # noqa: E402
from bench.sim.model import ModelConfig  # noqa: E402
from bench.sim.stream import StreamConfig, collector_nodes, store_check, stream  # noqa: E402


def test_light_agents_stream_every_record_exactly_once(tmp_path):
    c = CollectorProc(tmp_path).start()
    try:
        agents = 50
        cfg = ModelConfig(dp=agents, pp=8, tp=1, micro_batches=8, iterations=3, seed=1)
        faults = [parse_fault("slow_gpu:3:1:2", cfg.topology())]
        seen = {}

        def on_phase(name, info):
            if name == "connected":
                seen.update(collector_nodes(c.address))
        # small batches and a small backlog bound, so agents send several batches and wait on acks
        out = stream(cfg, faults, StreamConfig(collector=c.address, agents=agents, procs=2, agent_kind="light",
                                               batch_records=100, max_backlog=2, window_batches=2,
                                               agents_per_channel=16, connect_timeout_s=60, drain_timeout_s=60),
                     on_phase=on_phase)
        assert out["errors"] == [] and out["not_drained"] == 0, out
        assert out["connected"] == agents and seen["connected"] == agents, (out, seen)
        assert out["batches"] > 2 * agents  # really streamed, not one batch per agent
        assert out["records_acked"] == out["records"]

        nodes = collector_nodes(c.address)
        assert nodes["nodes"] == agents
        assert nodes["records_stored"] == out["records"], nodes
        assert nodes["batches_stored"] == out["batches"] and nodes["batches_duplicate"] == 0, nodes
        assert nodes["records_rejected"] == 0, nodes
        # each agent's final AgentStatus reached the store: produced == stored
        wait_for(lambda: collector_nodes(c.address)["records_produced"] == out["records"], 10,
                 what="final agent statuses stored")

        st = store_check(c.db)
        assert st["agents"] == agents and st["spools"] == agents, st
        assert st["seq_not_contiguous"] == [], st
        assert st["batches"] == out["batches"] and st["records"] == out["records"] and st["rejected"] == 0, st
        # the rows themselves: every record landed once (what real agents send: bench/sim/agentview.py)
        assert st["process_rows"] == cfg.gpus and st["step_rows"] == cfg.gpus * cfg.iterations, st
        assert st["sim_series"] == 0, st
        assert (st["metric_rows"] + st["flow_rows"] + st["process_rows"] + st["step_rows"]
                + st["comm_summary_rows"]) == out["records"], st
    finally:
        c.stop()
