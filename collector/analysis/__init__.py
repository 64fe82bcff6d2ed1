"""The collector's detectors, registered in one place (DETECTORS: name -> "module:SPEC").

Each entry is a module of its own in this package exporting SPEC (a base.DetectorSpec); modules are
imported when the engine starts, with no import side effects. tests/test_detectors_registry.py checks that
every entry loads, has a valid default config, a [detectors.<name>] table in systemd/collector.toml.example
showing the defaults, and a test file of its own (tests/test_detector_<name>.py).
"""

from __future__ import annotations

import importlib

DETECTORS: dict[str, str] = {
    "commtime": "steplens.collector.analysis.commtime:SPEC",
    "flows": "steplens.collector.analysis.flows:SPEC",
    "hang": "steplens.collector.analysis.hang:SPEC",
    "irregularity": "steplens.collector.analysis.irregularity:SPEC",
    "lateness": "steplens.collector.analysis.lateness:SPEC",
    "sentinel": "steplens.collector.analysis.sentinel:SPEC",
}


def load_spec(name: str, paths: dict[str, str] | None = None):
    """The DetectorSpec registered under name (ImportError/AttributeError propagate: fail at start-up)."""
    module_name, _, attr = (paths or DETECTORS)[name].partition(":")
    spec = getattr(importlib.import_module(module_name), attr or "SPEC")
    if spec.name != name:
        raise ValueError(f"detector {name!r} is registered, but its SPEC is named {spec.name!r}")
    return spec


def all_specs(paths: dict[str, str] | None = None) -> dict:
    return {name: load_spec(name, paths) for name in (paths or DETECTORS)}
