"""steplens testbed: emulated hosts as network namespaces, a steplens agent per host, a real gloo job, real faults.

Modules: `netns` (namespaces, bridge, PKI, collector and agents: up/down), `job` (the torch.distributed
training script, run once per rank), `faults` (inject faults, ground-truth log, step-log analysis),
`cli` (`steplens-testbed up|run|inject|status|down`). Needs root; torch only for `job`.
"""
