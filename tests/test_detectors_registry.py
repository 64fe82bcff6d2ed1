"""Every registered detector (collector/analysis DETECTORS) loads, has a valid default config, a table in
systemd/collector.toml.example showing its defaults, and a test file of its own; the [analysis] table of the
example shows the loop's defaults; bad analysis config fails at start-up."""

import dataclasses
import os
import subprocess
import sys

import pytest

from conftest import COLLECTOR, REPO
from steplens.collector.analysis import DETECTORS, load_spec
from steplens.collector.analysis.base import AnalysisSettings, DetectorConfig, DetectorSpec

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

EXAMPLE = os.path.join(REPO, "systemd", "collector.toml.example")


def _example() -> dict:
    with open(EXAMPLE, "rb") as fh:
        return tomllib.load(fh)


@pytest.mark.parametrize("name", sorted(DETECTORS))
def test_detector_is_complete(name):
    spec = load_spec(name)
    assert isinstance(spec, DetectorSpec) and spec.name == name and spec.description and spec.kinds
    assert name.isidentifier() and name == name.lower()
    assert DETECTORS[name].startswith(f"steplens.collector.analysis.{name}:")
    cfg = spec.config_class()
    assert isinstance(cfg, DetectorConfig)
    cfg.validate()
    table = _example().get("detectors", {}).get(name)
    assert table is not None, f"systemd/collector.toml.example needs a [detectors.{name}] table"
    assert set(table) == {f.name for f in dataclasses.fields(spec.config_class)}, "the example lists every key"
    assert spec.config_class(**table) == cfg, "the example shows the defaults"
    assert os.path.exists(os.path.join(REPO, "tests", f"test_detector_{name}.py"))


def test_example_analysis_table_shows_the_defaults():
    table = _example()["analysis"]
    assert set(table) == {f.name for f in dataclasses.fields(AnalysisSettings)}
    assert AnalysisSettings(**table) == AnalysisSettings()
    assert set(_example().get("detectors", {})) <= set(DETECTORS)


@pytest.mark.parametrize("toml, message", [
    ("[analysis]\nmax_cpu_fraction = 2.0\n", "max_cpu_fraction must be within"),
    ("[analysis]\nspeed = 1\n", "unknown key(s) in [analysis]: speed"),
    ("[detectors.nonesuch]\nenabled = true\n", "[detectors.nonesuch]: no such detector"),
    ("[alerts]\nx = 1\n", "unknown table(s) alerts"),
])
def test_bad_analysis_config_fails_at_start(tmp_path, toml, message):
    cfg = tmp_path / "collector.toml"
    cfg.write_text(f'[collector]\ndb = "{tmp_path / "c.db"}"\nlisten = "127.0.0.1:1"\ninsecure = true\n' + toml)
    out = subprocess.run([COLLECTOR, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not os.path.exists(tmp_path / "c.db")


def test_no_gc_pauses_the_collector_for_a_pass_and_restores_it():
    """The engine pauses Python's cyclic GC while detectors run (base.no_gc); nested or concurrent passes
    re-enable it only when the last one ends, and a process that had it off keeps it off."""
    import gc
    import threading
    from steplens.collector.analysis.base import no_gc
    assert gc.isenabled()
    inner_started, release = threading.Event(), threading.Event()

    def other_pass():
        with no_gc():
            inner_started.set()
            release.wait(5)
    t = threading.Thread(target=other_pass)
    with no_gc():
        assert not gc.isenabled()
        t.start()
        assert inner_started.wait(5)
    assert not gc.isenabled()  # the other pass still runs
    release.set()
    t.join(5)
    assert gc.isenabled()
    gc.disable()
    try:
        with no_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
