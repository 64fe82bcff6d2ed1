"""The job-side bootstrap (agent/bootstrap/site): inert without STEPLENS_BOOTSTRAP=1, never breaks a
Python start-up (also where torch is absent), does not import torch, chains to an existing
sitecustomize; the .pth line for site directories; `steplens-agent env`; the cupti arbitration rule,
the cupti record reader, and (gpu) cupti-python on a real GPU."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from conftest import AGENT, REPO, free_port, wait_for
from steplens.agent import bootstrap
from steplens.agent.commlog import RealtimeClock

SITE = bootstrap.site_dir()
NO_TORCH_PY = next(iter(sorted(glob.glob("/root/.pyenv/versions/3.12*/bin/python"))), "")
VENV_PY = os.path.join(REPO, ".venv", "bin", "python")

PROBE = ("import sys, threading; "
         "print(int('steplens_bootstrap' in sys.modules), int('torch' in sys.modules), "
         "sorted(t.name for t in threading.enumerate() if t.name.startswith('steplens')))")


def _run(py, code, **env):
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS_", "TORCH_"))}
    base.update(env)
    return subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=60, env=base)


@pytest.mark.skipif(not NO_TORCH_PY, reason="no pyenv 3.12 python")
def test_inert_without_the_variable_and_harmless_without_torch(tmp_path):
    out = _run(NO_TORCH_PY, PROBE, PYTHONPATH=SITE)
    assert out.returncode == 0 and out.stderr == "" and out.stdout.split()[:2] == ["0", "0"], out
    for value in ("0", "", "yes"):
        out = _run(NO_TORCH_PY, PROBE, PYTHONPATH=SITE, STEPLENS_BOOTSTRAP=value)
        assert out.stdout.split()[:2] == ["0", "0"], (value, out)
    # enabled in an interpreter that has no torch at all: starts, waits, the program runs untouched
    out = _run(NO_TORCH_PY, PROBE + "; import os; print(os.environ['TORCH_FR_BUFFER_SIZE'])",
               PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(tmp_path / "run"))
    assert out.returncode == 0 and out.stderr == "", out
    lines = out.stdout.splitlines()
    assert lines[0].startswith("1 0 ['steplens-bootstrap']") and lines[1] == "2000"
    # a runtime dir that cannot be created: falls back, still no error
    out = _run(NO_TORCH_PY, "import steplens_bootstrap as b; print(b.runtime_dir())", PYTHONPATH=SITE,
               STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR="/proc/steplens-cannot-exist")
    assert out.returncode == 0 and out.stderr == "" and "steplens-fr-" in out.stdout, out
    # the user's own TORCH_FR_BUFFER_SIZE wins
    out = _run(NO_TORCH_PY, "import os; print(os.environ['TORCH_FR_BUFFER_SIZE'])", PYTHONPATH=SITE,
               STEPLENS_BOOTSTRAP="1", TORCH_FR_BUFFER_SIZE="17", STEPLENS_RUNTIME_DIR=str(tmp_path))
    assert out.stdout.strip() == "17"


@pytest.mark.skipif(not NO_TORCH_PY, reason="no pyenv 3.12 python")
def test_a_broken_bootstrap_never_breaks_start_up(tmp_path):
    """Even a bootstrap module that raises on import leaves the program running."""
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("sitecustomize.py", "steplens_bootstrap.pth"):
        (broken / name).write_text(open(os.path.join(SITE, name)).read())
    (broken / "steplens_bootstrap.py").write_text("raise RuntimeError('boom')\n")
    out = _run(NO_TORCH_PY, "print('alive')", PYTHONPATH=str(broken), STEPLENS_BOOTSTRAP="1")
    assert out.returncode == 0 and out.stdout.strip() == "alive" and out.stderr == "", out
    code = f"import site; site.addsitedir({str(broken)!r}); print('alive')"
    out = _run(NO_TORCH_PY, code, STEPLENS_BOOTSTRAP="1")
    assert out.returncode == 0 and out.stdout.strip() == "alive" and out.stderr == "", out


@pytest.mark.skipif(not NO_TORCH_PY, reason="no pyenv 3.12 python")
def test_pth_line_in_a_site_directory(tmp_path):
    code = f"import site, sys; site.addsitedir({SITE!r}); print(int('steplens_bootstrap' in sys.modules))"
    assert _run(NO_TORCH_PY, code).stdout.strip() == "0"
    out = _run(NO_TORCH_PY, code, STEPLENS_BOOTSTRAP="1", STEPLENS_RUNTIME_DIR=str(tmp_path))
    assert out.stdout.strip() == "1" and out.stderr == "", out


@pytest.mark.skipif(not NO_TORCH_PY, reason="no pyenv 3.12 python")
def test_chains_to_the_sitecustomize_it_shadows(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins; builtins.STEPLENS_TEST_CHAINED = True\n")
    code = "import builtins; print(getattr(builtins, 'STEPLENS_TEST_CHAINED', False))"
    for flag in ("0", "1"):
        out = _run(NO_TORCH_PY, code, PYTHONPATH=os.pathsep.join([SITE, str(other)]), STEPLENS_BOOTSTRAP=flag,
                   STEPLENS_RUNTIME_DIR=str(tmp_path))
        assert out.stdout.strip() == "True" and out.stderr == "", out


@pytest.mark.skipif(not os.path.exists(VENV_PY), reason="no .venv python")
def test_does_not_import_torch_in_a_process_that_does_not(tmp_path):
    """In the venv that has torch: a program that never imports it does not get it from the bootstrap."""
    out = _run(VENV_PY, "import time; time.sleep(0.5); " + PROBE, PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1",
               STEPLENS_BOOTSTRAP_POLL_S="0.05", STEPLENS_RUNTIME_DIR=str(tmp_path))
    assert out.returncode == 0 and out.stdout.split()[:2] == ["1", "0"], out
    assert not list(tmp_path.glob("*.sock"))


def _pairs(text: str) -> dict:
    return dict(ln.split("=", 1) for ln in text.splitlines())


def test_env_command_prints_key_value_lines():
    """The default output is bare KEY=VALUE lines and nothing else; --explain puts the notes on stderr."""
    out = subprocess.run([AGENT, "env"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stderr == "", out
    assert all(ln and not ln.startswith("#") and "=" in ln and " " not in ln for ln in out.stdout.splitlines()), out
    pairs = _pairs(out.stdout)
    assert pairs["KINETO_USE_DAEMON"] == "1" and pairs["STEPLENS_BOOTSTRAP"] == "1"
    assert pairs["PYTHONPATH"] == SITE and os.path.exists(os.path.join(SITE, "sitecustomize.py"))
    assert pairs["NCCL_DEBUG"] == "INFO" and pairs["NCCL_DEBUG_SUBSYS"] == "INIT,COLL"
    assert pairs["NCCL_DEBUG_FILE"].endswith("nccl.%h.%p.log") and int(pairs["TORCH_FR_BUFFER_SIZE"]) > 0
    explained = subprocess.run([AGENT, "env", "--explain"], capture_output=True, text=True, timeout=30)
    assert explained.returncode == 0 and _pairs(explained.stdout) == pairs, explained
    notes = explained.stderr.splitlines()
    assert any("attach at run time" in c for c in notes) and any("at launch" in c for c in notes)
    assert any("Flight Recorder ring" in c for c in notes)
    out = subprocess.run([AGENT, "env", "--no-kineto", "--no-nccl-log", "--cupti", "--fr-buffer-size", "50"],
                         capture_output=True, text=True, timeout=30)
    pairs = _pairs(out.stdout)
    assert "KINETO_USE_DAEMON" not in pairs and "NCCL_DEBUG" not in pairs
    assert pairs["STEPLENS_CUPTI"] == "1" and pairs["TORCH_FR_BUFFER_SIZE"] == "50"


SHOW_ENV = ("import os, json; print(json.dumps({k: os.environ.get(k) for k in "
            "('STEPLENS_BOOTSTRAP', 'PYTHONPATH', 'NCCL_DEBUG_FILE', 'KINETO_USE_DAEMON', 'STEPLENS_RUNTIME_DIR')}))")


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("STEPLENS_", "TORCH_", "NCCL_", "KINETO_")) and k != "PYTHONPATH"}


def test_env_output_works_in_env_export_and_eval(tmp_path):
    """As the README shows it: `env $(steplens-agent env) CMD`, `export $(...)`, `eval "$(... --format shell)"`,
    and --format json; every variable arrives in the program."""
    want = _pairs(subprocess.run([AGENT, "env"], capture_output=True, text=True, timeout=30).stdout)
    py = sys.executable
    for script in (f'env $("{AGENT}" env) "{py}" -c "$SHOW"',
                   f'export $("{AGENT}" env) && "{py}" -c "$SHOW"',
                   f'eval "$("{AGENT}" env --format shell)" && "{py}" -c "$SHOW"',
                   f'eval "$("{AGENT}" env --format shell --explain)" && "{py}" -c "$SHOW"'):
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                             env=_clean_env() | {"SHOW": SHOW_ENV})
        assert out.returncode == 0, (script, out.stderr)
        got = json.loads(out.stdout)
        assert got == {k: want[k] for k in got}, (script, got)
    # shell format quotes what needs quoting: a runtime dir with a space and a quote survives eval
    odd = str(tmp_path / "run dir's")
    script = f'eval "$("{AGENT}" env --format shell --runtime-dir "$ODD")" && "{py}" -c "$SHOW"'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                         env=_clean_env() | {"SHOW": SHOW_ENV, "ODD": odd})
    assert out.returncode == 0 and json.loads(out.stdout)["STEPLENS_RUNTIME_DIR"] == odd, out
    # ... which the env format cannot carry through `env $(...)`: it refuses, says why, prints nothing
    out = subprocess.run([AGENT, "env", "--runtime-dir", odd], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and out.stdout == "" and "--format shell" in out.stderr, out
    out = subprocess.run([AGENT, "env", "--format", "json", "--runtime-dir", odd], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0 and json.loads(out.stdout)["STEPLENS_RUNTIME_DIR"] == odd
    assert json.loads(out.stdout)["PYTHONPATH"] == SITE


def test_env_follows_the_agent_config(tmp_path):
    """The job must poll the socket the agent's kineto source listens on, and put its Flight Recorder socket
    where the flightrec source looks."""
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[sources.kineto]\nsocket_dir = "/run/sl/k"\n[sources.flightrec]\nsocket_dirs = ["/run/sl/fr"]\n')
    out = subprocess.run([AGENT, "env", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    pairs = _pairs(out.stdout)
    assert pairs["KINETO_IPC_SOCKET_DIR"] == "/run/sl/k" and pairs["STEPLENS_RUNTIME_DIR"] == "/run/sl/fr"


def test_cupti_arbitration_rule():
    sys.path.insert(0, SITE)
    try:
        import steplens_cupti as c
    finally:
        sys.path.remove(SITE)
    assert c.allowed({}, (12, 8))[0] is False
    assert c.allowed({"STEPLENS_CUPTI": "1"}, (12, 8)) == (True, "")
    ok, why = c.allowed({"STEPLENS_CUPTI": "1", "KINETO_USE_DAEMON": "1"}, (12, 8))
    assert not ok and "13.2" in why
    assert c.allowed({"STEPLENS_CUPTI": "1", "KINETO_USE_DAEMON": "1"}, (13, 2))[0]


def test_read_cupti_joins_launches_and_keeps_partial_lines(tmp_path):
    clock = RealtimeClock()
    off = clock.offset_ns
    path = tmp_path / "123.cupti.jsonl"
    line = {"pid": 123, "dropped": 2,
            "k": [["gemm", 0, 7, off + 2_000, off + 5_000, 42, 4, 1, 1, 128, 1, 1, 0]],
            "a": [["runtime", 211, off + 1_000, off + 1_500, 42, 99]]}
    path.write_text(json.dumps(line) + "\nnot json\n" + json.dumps(line)[:20])
    kernels, pos, dropped = bootstrap.read_cupti(str(path), 0, clock, rank=3)
    assert len(kernels) == 1 and dropped == 2 and pos == len(path.read_bytes()) - 20
    k = kernels[0]
    assert k.name == "gemm" and k.correlation_id == 42 and k.launch_api == "runtime:211" and k.rank == 3
    assert abs(k.start_mono_ns - k.launch_start_mono_ns - 1_000) <= 1 and k.grid == [4, 1, 1]
    assert bootstrap.read_cupti(str(path), pos, clock)[0] == []


def _anchors_module():
    sys.path.insert(0, SITE)
    try:
        import steplens_anchors
    finally:
        sys.path.remove(SITE)
    return steplens_anchors


def test_anchor_ring_round_trip_wrap_torn_slot_and_pid_reuse(tmp_path):
    """The bootstrap's ring (steplens_anchors, written in the job) as the flightrec source reads it (its own
    copy of the layout): numbers and times, the wrap, a slot being rewritten, another process's file."""
    from steplens.agent.sources.flightrec import FlightrecError, header_anchors, read_anchor_ring
    a = _anchors_module()
    path = str(tmp_path / "77.anchors")
    ring = a.Ring(path, start_ticks=555, slots=8)
    assert read_anchor_ring(path, 555, -1) == [] and os.path.getsize(path) == a.HEADER_BYTES + 8 * a.SLOT_BYTES
    for k in range(5):
        ring.add(1_000 + k)
    assert read_anchor_ring(path, 555, -1) == [(k, 1_000 + k) for k in range(5)] == a.read(path, 555)[0]
    assert read_anchor_ring(path, 555, 3) == [(4, 1_004)]
    for k in range(5, 15):
        ring.add(1_000 + k)
    # 15 written into 8 slots: 7..14 are held, and 7 is left out (the writer could be rewriting its slot)
    assert read_anchor_ring(path, 555, 4) == [(k, 1_000 + k) for k in range(8, 15)]
    assert header_anchors({"version": 1, "clock": "realtime", "anchors": ring.snapshot()}) == \
        [(k, 1_000 + k) for k in range(7, 15)]
    import struct
    struct.pack_into("<Q", ring.map, a.HEADER_BYTES + (13 % 8) * a.SLOT_BYTES, 0)  # slot 13 mid-rewrite
    assert [n for n, _ in read_anchor_ring(path, 555, 10)] == [11, 12, 14]
    with pytest.raises(FlightrecError, match="pid reused"):
        read_anchor_ring(path, 556, -1)
    struct.pack_into("<I", ring.map, 8, 2)  # a layout this agent does not know: refused, said, no crash
    with pytest.raises(FlightrecError, match="layout version 2 .*reads version 1") as err:
        read_anchor_ring(path, 555, -1)
    assert err.value.kind == "bad_anchors" and "version 2" in a.read(path, 555)[1]
    with pytest.raises(FlightrecError, match="version 2"):
        header_anchors({"version": 2, "clock": "realtime", "anchors": []})
    struct.pack_into("<I", ring.map, 8, 1)
    with pytest.raises(FlightrecError):
        header_anchors({"version": 1, "clock": "realtime", "anchors": [[1, -5]]})
    ring.close()
    assert not os.path.exists(path)
    with pytest.raises(FileNotFoundError):
        read_anchor_ring(path, 555, -1)


def test_anchors_of_a_real_optimizer_and_a_clean_exit_while_polled(tmp_path):
    """A gloo process (world 1) under the bootstrap runs 30 SGD steps, each followed by zero_grad: two anchors
    per iteration, the optimizer step's end and the zero_grad's, each between the loop's own clock reads, in
    the ring beside the socket; the exit, while the worker server is being asked for its dump, writes the
    anchors into the exit dump's header and removes the ring."""
    from steplens.agent.sources.flightrec import FlightrecError, http_post_unix, read_anchor_ring, read_exit_dump
    code = ("import os, sys, time, json, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo', rank=0, world_size=1)\n"
            "m = torch.nn.Linear(64, 64); opt = torch.optim.SGD(m.parameters(), lr=0.1); marks = []\n"
            "while not os.path.exists(sys.argv[1]): time.sleep(0.02)\n"
            "for _ in range(30):\n"
            "    m(torch.randn(8, 64)).sum().backward(); a = time.time_ns(); opt.step(); b = time.time_ns()\n"
            "    opt.zero_grad(); c = time.time_ns(); marks.append((a, b, c)); time.sleep(0.01)\n"
            "print(json.dumps(marks))\n"
            "while not os.path.exists(sys.argv[2]): time.sleep(0.02)\n")
    go, done = tmp_path / "go", tmp_path / "done"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS_", "TORCH_"))}
    env.update(PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1", STEPLENS_BOOTSTRAP_POLL_S="0.05",
               STEPLENS_RUNTIME_DIR=str(tmp_path), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               STEPLENS_FR_SERVER_NICE="10")
    p = subprocess.Popen([VENV_PY, "-c", code, str(go), str(done)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        sock, ring = tmp_path / f"{p.pid}.sock", tmp_path / f"{p.pid}.anchors"
        wait_for(lambda: sock.exists() or p.poll() is not None, 120, what="the worker-server socket")
        assert ring.exists(), p.stderr.read() if p.poll() is not None else "no ring"
        # the worker server's threads run at STEPLENS_FR_SERVER_NICE (10 here; off by default), the program's own
        # at its nice; read until the server's threads are named and the short-lived thread that made them at
        # nice 10 has ended (the socket can come first: a fresh-boot CI run once read a "python" thread at 10)
        own = os.getpriority(os.PRIO_PROCESS, 0)
        deadline = time.monotonic() + 10
        while True:
            nice: dict = {}
            for tid in os.listdir(f"/proc/{p.pid}/task"):
                try:
                    with open(f"/proc/{p.pid}/task/{tid}/stat") as fh:
                        st = fh.read()
                except FileNotFoundError:   # a thread that just ended
                    continue
                nice.setdefault(st[st.find("(") + 1:st.rfind(")")], set()).add(int(st[st.rfind(")") + 2:].split()[16]))
            ok = nice.get("pt_workerserver") == {10} and nice.get("python") == {own}
            if ok or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert ok, nice
        go.touch()
        marks = json.loads(p.stdout.readline())
        with open(f"/proc/{p.pid}/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])
        got = read_anchor_ring(str(ring), ticks, -1)
        assert [n for n, _ in got] == list(range(60))
        assert all(a <= s <= b <= z <= c for (a, b, c), (_, s), (_, z) in zip(marks, got[::2], got[1::2]))
        done.touch()
        while p.poll() is None:  # ask the server all through the exit (a Python handler deadlocked here)
            try:
                http_post_unix(str(sock), "fr_trace_json", timeout_s=1.0)
            except FlightrecError:
                pass
        assert p.wait(timeout=30) == 0, p.stderr.read()[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert not ring.exists() and not sock.exists()
    (dump,) = tmp_path.glob("*.fr-exit.json")
    header, _ = read_exit_dump(str(dump))
    assert [n for n, _ in header["anchors"]["anchors"]] == list(range(60))


class _Opt:
    """Stands in for a torch optimizer (this test needs no torch): step() calls the global post hook as
    torch's step wrapper does, zero_grad() is wrapped as steplens_anchors.patch_zero_grad wraps torch's."""

    def __init__(self, a, work):
        self.a, self.work = a, work

    def step(self):
        self.a._on_optimizer_step(self, (), {})


class _Accelerated:
    """A wrapper library's optimizer (accelerate's AcceleratedOptimizer): step and zero_grad forward."""

    def __init__(self, opt):
        self.opt = opt

    def step(self):
        self.opt.step()

    def zero_grad(self):
        self.opt.zero_grad()


def test_zero_grad_ends_the_iteration_only_after_the_step_in_the_same_loop_body(tmp_path):
    """The first zero_grad after an optimizer step is an anchor too (its end: where `step(); zero_grad()`
    loops end the iteration) when it comes later in the loop body than the step, also through a wrapper or
    from a Module (HF Trainer's model.zero_grad()); not at the top of the next iteration, not in the
    tutorials' `forward; zero_grad(); backward; step()`, not inside the step call (a closure), not for
    another optimizer's step, not twice, and not with a kind of zero_grad that was not wrapped."""
    a = _anchors_module()
    marks = []

    def work(self, *args, **kwargs):
        marks.append(time.time_ns())
        time.sleep(0.001)  # zeroing the gradients

    _Opt.zero_grad = a._wrap_zero_grad(work, True)
    module_zero_grad = a._wrap_zero_grad(work, False)
    ring = a.Ring(str(tmp_path / "1.anchors"), start_ticks=1, slots=256)
    a._ring, a._zero_grad = ring, True  # what install() sets, less torch
    try:
        opt, other = _Opt(a, work), _Opt(a, work)
        acc = _Accelerated(opt)

        def count(loop):
            n0 = ring.count
            for _ in range(3):
                loop()
            return (ring.count - n0) / 3

        def zero_grad_after():
            opt.step()
            opt.zero_grad()
            opt.zero_grad()  # a second one is not an anchor

        def zero_grad_at_the_top():
            opt.zero_grad()
            opt.step()

        def tutorial():
            marks.append(0)  # the forward
            opt.zero_grad()
            opt.step()

        def through_a_wrapper():
            acc.step()
            acc.zero_grad()

        def wrapper_at_the_top():
            acc.zero_grad()
            acc.step()

        def module_after():
            opt.step()
            module_zero_grad(None)

        def inside_the_step():  # Lightning: the closure's zero_grad runs inside the step call
            step_with(lambda: opt.zero_grad())

        def step_with(closure):
            closure()
            opt.step()

        def helper_after():
            opt.step()
            cleanup()

        def cleanup():
            opt.zero_grad()

        def two_optimizers_zero_grad_first():  # a GAN written zero_grad-first: neither is an iteration end
            opt.zero_grad()
            opt.step()
            other.zero_grad()
            other.step()

        assert count(zero_grad_after) == 2 and count(through_a_wrapper) == 2 and count(module_after) == 2
        assert count(helper_after) == 2
        assert count(zero_grad_at_the_top) == 1 and count(tutorial) == 1 and count(wrapper_at_the_top) == 1
        assert count(inside_the_step) == 1 and count(two_optimizers_zero_grad_first) == 2
        # the anchor is the zero_grad's end: after its work began, before the caller goes on
        n = ring.count
        opt.step()
        opt.zero_grad()
        after = time.time_ns()
        got = a.read(ring.path, 1, n - 1)[0]
        assert [k for k, _ in got] == [n, n + 1] and marks[-1] + 1_000_000 <= got[1][1] <= after
        assert got[0][1] <= marks[-1]
        a._ring = None  # closed: the wrappers only call through
        opt.step()
        opt.zero_grad()
        assert ring.count == n + 2
    finally:
        a._ring, a._last_step, a._zero_grad = None, None, False
        ring.close()


def test_which_zero_grad_ends_an_iteration_is_decided_by_the_call_sites():
    """ends_iteration on hand-made call stacks: the innermost common function decides (functions by identity:
    these four code objects compare equal)."""
    a = _anchors_module()
    loop, body, wrap_step, wrap_zero = (compile("0", n, "eval") for n in ("loop", "body", "ws", "wz"))
    other = compile("0", "other", "eval")
    step = ((wrap_step, body, loop), (10, 40, 8))

    def ends(*frames):
        return a.ends_iteration(*step, frames)
    assert ends((wrap_zero, 6), (body, 44), (loop, 8))       # after the step, in the same body
    assert not ends((wrap_zero, 6), (body, 12), (loop, 8))   # body's top: the next iteration
    assert not ends((body, 40), (loop, 8))                    # the same call: inside the step
    assert ends((loop, 9))                                    # the loop, after body()
    assert not ends((other, 3))                               # nothing in common
    assert not a.ends_iteration((), (), [(loop, 9)])


def test_anchors_of_zero_grad_in_real_torch_loops(tmp_path):
    """torch, no process group: install() wraps Optimizer.zero_grad and Module.zero_grad; per iteration a
    `step(); zero_grad()` loop gets two anchors (the second between zero_grad's return and the loop's next
    clock read), a zero_grad-first loop and the tutorials' loop one, gradient accumulation two per optimizer
    step; install(zero_grad=False) keeps one; torch.compile (eager backend) of a function calling
    Module.zero_grad still traces it without a graph break."""
    code = ("import sys, json, time, tempfile, torch\n"
            "import steplens_anchors as A\n"
            "zg = sys.argv[2] == '1'\n"
            "ring = A.install(sys.argv[1], 1, zero_grad=zg)\n"
            "m = torch.nn.Linear(64, 64); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "def fb(): m(torch.randn(8, 64)).sum().backward()\n"
            "out = {}\n"
            "def run(name, body, n=5):\n"
            "    c = ring.count\n"
            "    for _ in range(n): body()\n"
            "    out[name] = (ring.count - c) / n\n"
            "marks = []\n"
            "def after():\n"
            "    fb(); opt.step(); opt.zero_grad(set_to_none=False); marks.append(time.time_ns())\n"
            "def top(): opt.zero_grad(); fb(); opt.step()\n"
            "def tutorial():\n"
            "    loss = m(torch.randn(8, 64)).sum(); opt.zero_grad(); loss.backward(); opt.step()\n"
            "def module(): fb(); opt.step(); m.zero_grad()\n"
            "def accumulate():\n"
            "    for _ in range(4): fb()\n"
            "    opt.step(); opt.zero_grad()\n"
            "c0 = ring.count\n"
            "for f in (after, top, tutorial, module, accumulate): run(f.__name__, f)\n"
            "got = A.read(ring.path, 1, c0 - 1)[0][:10]\n"
            "out['ordered'] = all(got[2 * i + 1][1] <= marks[i] for i in range(5)) if zg else None\n"
            "if zg:\n"
            "    def f(x):\n"
            "        y = m(x).sum(); m.zero_grad(); return y\n"
            "    e = torch._dynamo.explain(f)(torch.randn(2, 64))\n"
            "    out['graph_breaks'] = e.graph_break_count\n"
            "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("STEPLENS_", "TORCH_"))}
    env.update(PYTHONPATH=SITE)
    res = {}
    for zg in ("1", "0"):
        p = subprocess.run([VENV_PY, "-c", code, str(tmp_path), zg], capture_output=True, text=True, env=env,
                           timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        res[zg] = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["1"] == {"after": 2, "top": 1, "tutorial": 1, "module": 2, "accumulate": 2, "ordered": True,
                        "graph_breaks": 0}, res
    assert res["0"] == {"after": 1, "top": 1, "tutorial": 1, "module": 1, "accumulate": 1, "ordered": None}, res


@pytest.mark.gpu
def test_cupti_records_kernels_of_a_gemm_loop(tmp_path):
    """Real GPU only: a GEMM loop under the bootstrap with STEPLENS_CUPTI=1 writes kernel + launch records."""
    check = _run(VENV_PY, "import torch, cupti, sys; sys.exit(0 if torch.cuda.is_available() else 3)")
    if check.returncode != 0:
        pytest.skip("needs torch with CUDA, a GPU and cupti-python in .venv")
    code = ("import torch, time\n"
            "a = torch.randn(1024, 1024, device='cuda')\n"
            "time.sleep(0.5)\n"
            "for _ in range(50): a = a @ a; a = a / a.norm()\n"
            "torch.cuda.synchronize()\n"
            "import steplens_cupti; steplens_cupti.stop(); print(steplens_cupti.status())\n")
    out = _run(VENV_PY, code, PYTHONPATH=SITE, STEPLENS_BOOTSTRAP="1", STEPLENS_CUPTI="1",
               STEPLENS_BOOTSTRAP_POLL_S="0.05", STEPLENS_RUNTIME_DIR=str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    files = list(tmp_path.glob("*.cupti.jsonl"))
    assert files, out.stdout + out.stderr[-2000:]
    kernels, _, _ = bootstrap.read_cupti(str(files[0]))
    assert len(kernels) >= 50
    assert all(k.end_mono_ns >= k.start_mono_ns > 0 for k in kernels)
    assert sum(1 for k in kernels if k.launch_start_mono_ns) >= 25
