"""steplens: diagnose distributed LLM training and inference from outside the jobs.

This package root lives in proto/ beside the wire contract (steplens/v1); the agent and the
collector are mapped in as steplens.agent and steplens.collector (see pyproject.toml).
"""

__version__ = "0.1.0"
SCHEMA_VERSION = 1
