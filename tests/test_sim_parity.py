"""Simulator parity (issue 13, item 5): detectors see only what a real cluster gives them.

(a) no module in collector/analysis/ reads a simulator-only name (sim_* metrics, the step files' compute /
    wait / stall split, truth.json, the simulator's files or package);
(b) a simulated job streamed to a real collector on loopback lands as what real agents send: a job from the
    processes' ProcessInfo (job key, ranks, world size) in `steplens jobs --json`, Step rows for every rank,
    CommSummary rows, NVML metrics under their real names, and no sim_* metric."""

import ast
import io
import json
import os
import re
import sqlite3
import subprocess
import sys
import tokenize

from conftest import REPO, wait_for

sys.path.insert(0, REPO)

from steplens.agent.sources.gpu import DCGM_NAMES  # noqa: E402

ANALYSIS = os.path.join(REPO, "collector", "analysis")
# simulator-only names: its metrics, the step files' fields beyond what a Step record has, its files, its package
FORBIDDEN = re.compile(r"\bsim_\w*|\btruth\b|truth\.json|\bcompute_ns\b|\bcomm_wait_ns\b|\bstall_ns\b"
                       r"|steps\.(?:csv|jsonl)|commops\.jsonl|telemetry\.jsonl|flows\.jsonl|\bbench\b")
# names and strings only: `bench` (the simulator's package, as in `from bench.sim import ...`) is a NAME token


def _code_text(path: str) -> list[tuple[int, str]]:
    """(line, text) of every name and string literal of a module, docstrings and comments left out (a detector
    may say in prose that it never sees the ground truth; it may not read it)."""
    with open(path, encoding="utf-8") as fh:
        src = fh.read()
    docs = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                docs.add((first.lineno, first.col_offset))
    kinds = {tokenize.NAME, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}  # 3.12+
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(src).readline)
            if tok.type in kinds and tok.start not in docs]


def test_no_detector_reads_simulator_only_names():
    hits = []
    files = sorted(f for f in os.listdir(ANALYSIS) if f.endswith(".py"))
    assert "__init__.py" in files and len(files) > 1
    for f in files:
        for n, text in _code_text(os.path.join(ANALYSIS, f)):
            for m in FORBIDDEN.finditer(text):
                hits.append(f"collector/analysis/{f}:{n}: {m.group(0)!r} in {text[:100]!r}")
    assert not hits, "detectors must read only what real agents send:\n" + "\n".join(hits)


def test_forbidden_pattern_catches_what_it_should(tmp_path):
    mod = tmp_path / "m.py"
    mod.write_text('"""Never sees the ground truth (truth.json)."""\n# not compute_ns either\n'
                   'def f(r, x):\n    """sim_ prose."""\n    return r.metric("sim_step_seconds"), r["comm_wait_ns"], '
                   'f"sim_{x}"\n')
    found = [(n, m.group(0)) for n, t in _code_text(str(mod)) for m in FORBIDDEN.finditer(t)]
    assert found[:2] == [(5, "sim_step_seconds"), (5, "comm_wait_ns")] and len(found) == 3, found
    for bad in ("m = reader.metric('sim_step_seconds')", "json.load(open('truth.json'))", "row['comm_wait_ns']",
                "pd.read_csv('steps.csv')", "from bench.sim import model"):
        assert FORBIDDEN.search(bad), bad
    for ok in ("step.end_ns - step.start_ns", "c['busy_ns']", "similarity = 0.5", "cosine_simple"):
        assert not FORBIDDEN.search(ok), ok


def test_streamed_sim_job_is_what_real_agents_send(collector, tmp_path):
    cfg_args = ["--gpus", "16", "--dp", "2", "--pp", "2", "--tp", "4", "--gpus-per-node", "4", "--iterations", "6",
                "--micro-batches", "4", "--fault", "slow_gpu:3:2:4"]
    out = subprocess.run([sys.executable, "-m", "bench.sim", "stream", *cfg_args, "--collector", collector.address,
                          "--insecure", "--agent-kind", "light", "--job-key", "slurm:4242"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["agents"] == 4 and not summary["errors"] and summary["records_acked"] == summary["records"]

    def stored():
        nodes = [n for n in collector.cli("nodes") if n["node_id"].startswith("sim-node-")]
        return sum(n.get("records_stored", 0) for n in nodes) == summary["records"] or None
    wait_for(stored, 20, what="every streamed record stored")

    jobs = {j["job_key"]: j for j in collector.cli("jobs")}
    assert "slurm:4242" in jobs, sorted(jobs)
    job = jobs["slurm:4242"]
    assert job["world_size"] == 16
    assert sorted(r["rank"] for r in job["ranks"]) == list(range(16))
    assert {r["node_id"] for r in job["ranks"]} == {f"sim-node-{n}" for n in range(4)}
    assert all(r["node_id"] == f"sim-node-{r['rank'] // 4}" for r in job["ranks"])

    db = sqlite3.connect(f"file:{collector.db}?mode=ro", uri=True)
    try:
        steps = db.execute("SELECT rank, COUNT(*), MIN(evidence), MAX(evidence) FROM steps WHERE job_key = ?"
                           " GROUP BY rank", ("slurm:4242",)).fetchall()
        comm_summaries = db.execute("SELECT COUNT(*) FROM comm_summaries WHERE job_key = ?",
                                    ("slurm:4242",)).fetchone()[0]
        names = {r[0] for r in db.execute("SELECT DISTINCT name FROM series WHERE agent_id LIKE 'sim-node-%'")}
        sources = {r[0] for r in db.execute("SELECT DISTINCT source FROM steps")}
        comms = json.loads(db.execute("SELECT comms_json FROM steps WHERE job_key = ? AND rank = 5 LIMIT 1",
                                      ("slurm:4242",)).fetchone()[0])
    finally:
        db.close()
    assert sorted(r[0] for r in steps) == list(range(16)) and all(r[1] == 6 for r in steps), steps
    assert {r[2] for r in steps} == {"comm_pattern"}
    assert sources == {"flightrec"}
    assert comm_summaries > 0
    assert names and names <= set(DCGM_NAMES) and not [n for n in names if n.startswith("sim_")], names
    assert {c["comm_id"] for c in comms} >= {"tp.s0.d1", "dp.s0.t1"}, comms


def test_light_agents_answer_fetch_detail_with_commops(collector):
    """Progressive fetching works against the simulator: `steplens commops JOB --rank R` reaches the emulated
    agent hosting R, which answers from agentview.commops(), as a real agent answers from its detail store."""
    from bench.sim.agentview import commops
    from bench.sim.model import ModelConfig
    proc = subprocess.Popen([sys.executable, "-m", "bench.sim", "stream", "--gpus", "8", "--dp", "2", "--pp", "2",
                             "--tp", "2", "--gpus-per-node", "2", "--iterations", "4", "--micro-batches", "2",
                             "--collector", collector.address, "--insecure", "--agent-kind", "light",
                             "--job-key", "simfetch", "--linger", "10"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def streamed():
            job = [j for j in collector.cli("jobs") if j["job_key"] == "simfetch"]
            return job and len(job[0]["ranks"]) == 8 and job[0]["steps"] > 0 or None
        wait_for(streamed, 30, what="the sim job's processes and steps stored")
        rows = wait_for(lambda: [r for r in collector.cli("commops", "simfetch", "--rank", "5", "--since", "")
                                 if r["kind"] == "commop"] or None, 15, what="rank 5's commops fetched")
        want = commops(ModelConfig(dp=2, pp=2, tp=2, gpus_per_node=2, iterations=4, micro_batches=2), [], [5], 0, 0)
        assert len(rows) == len(want) and {r["rank"] for r in rows} == {5}
        assert {r["node_id"] for r in rows} == {"sim-node-2"}
        assert sorted((r["comm_id"], r["op"]) for r in rows) == sorted((o.comm_id, o.op) for o in want)
        assert all(r["end_ns"] >= r["start_ns"] > 0 for r in rows)
    finally:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert json.loads(out)["records_acked"] > 0
