"""Every registered source has a valid default config, a table in systemd/agent.toml.example,
a description, and a test file of its own."""

import dataclasses
import os
import sys

import pytest

from conftest import REPO
from steplens.agent.sources import SOURCE_PATHS, all_source_classes, load_source_class
from steplens.agent.sources.base import Source, SourceConfig

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

EXAMPLE = os.path.join(REPO, "systemd", "agent.toml.example")


@pytest.mark.parametrize("name", sorted(SOURCE_PATHS))
def test_source_is_complete(name):
    cls = load_source_class(name)
    assert issubclass(cls, Source) and cls.name == name and cls.description
    cfg = cls.config_class()
    assert isinstance(cfg, SourceConfig)
    cfg.validate()
    with open(EXAMPLE, "rb") as fh:
        example = tomllib.load(fh)
    table = example["sources"][name]
    assert set(table) == {f.name for f in dataclasses.fields(cls.config_class)}, \
        f"systemd/agent.toml.example [sources.{name}] must list every key"
    assert cls.config_class(**table) == cfg, "the example shows the defaults"
    assert os.path.exists(os.path.join(REPO, "tests", f"test_source_{name}.py"))


def test_agent_example_lists_every_agent_key():
    from steplens.agent.config import AgentSettings
    with open(EXAMPLE, "rb") as fh:
        example = tomllib.load(fh)
    assert set(example["agent"]) == {f.name for f in dataclasses.fields(AgentSettings)}


def test_broken_source_module_is_unavailable_not_fatal(monkeypatch):
    monkeypatch.setitem(SOURCE_PATHS, "broken", "steplens.agent.sources.does_not_exist:Nope")
    classes = all_source_classes()
    avail = classes["broken"].probe(None)
    assert not avail.ok and "failed to import" in avail.reason
