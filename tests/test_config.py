"""Bad configuration fails at start-up with the reason, before any thread runs."""

import subprocess

import pytest

from conftest import AGENT, COLLECTOR, REPO
from steplens.agent import config
from steplens.agent.sources.base import ConfigError


def _write(tmp_path, text):
    p = tmp_path / "agent.toml"
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text, message", [
    ("[agent]\nbatch_max_records = 0\n", "batch_max_records"),
    ("[agent]\nbogus = 1\n", "unknown key(s) bogus"),
    ("[agent]\ninsecure = 'yes'\n", "must be true or false"),
    ("[sources.host]\ninterval_seconds = -1\n", "interval_seconds"),
    ("[sources.nope]\n", "unknown source(s) nope"),
    ("[sources.procs]\npatterns = ['(']\n", "[sources.procs]"),
    ("[agent\n", "not valid TOML"),
    ("[other]\n", "unknown top-level"),
    ("[agent]\ngc_young_threshold = 10\n", "gc_young_threshold"),
])
def test_bad_config_is_refused(tmp_path, text, message):
    with pytest.raises(ConfigError) as exc:
        config.load(_write(tmp_path, text), check_transport=False)
    assert message in str(exc.value)


def test_cli_exits_2_before_starting(tmp_path):
    out = subprocess.run([AGENT, "run", "--config", _write(tmp_path, "[agent]\nwindow_batches = 0\n"), "--insecure",
                          "--state-dir", str(tmp_path / "s")], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "window_batches" in out.stderr
    assert not (tmp_path / "s").exists()


def test_unwritable_state_dir_fails_fast(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "state").write_text("a file, not a directory")
    out = subprocess.run([AGENT, "run", "--insecure", "--state-dir", str(ro / "state" / "x")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "state dir" in out.stderr


def test_metrics_port_in_use_fails_fast(tmp_path):
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run([AGENT, "run", "--insecure", "--state-dir", str(tmp_path / "s"),
                              "--metrics-listen", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "/metrics" in out.stderr


def test_example_configs_load(tmp_path):
    cfg = config.load(f"{REPO}/systemd/agent.toml.example", {"agent": {"insecure": True}})
    from steplens.agent.sources import SOURCE_PATHS
    assert cfg.agent.collector == "127.0.0.1:7707" and set(cfg.sources) == set(SOURCE_PATHS)
    # the collector example needs its certificate files: it must fail on exactly that, not on a key
    out = subprocess.run([COLLECTOR, "serve", "--config", f"{REPO}/systemd/collector.toml.example"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "cannot read TLS" in out.stderr, out.stderr


def test_print_config_round_trips(tmp_path):
    out = subprocess.run([AGENT, "print-config", "--node-id", "n9"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    again = config.load(_write(tmp_path, out.stdout), check_transport=False)
    assert again.agent.node_id == "n9" and again.sources["host"].interval_seconds == 1.0


def test_tune_gc_freezes_start_up_and_sets_the_young_threshold():
    import gc

    from steplens.agent.cli import tune_gc
    before = gc.get_threshold()
    try:
        tune_gc(0)
        assert gc.get_threshold() == before and gc.get_freeze_count() > 0
        gc.unfreeze()
        tune_gc(20_000)
        assert gc.get_threshold() == (20_000, *before[1:]) and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
