"""steplens cluster simulator: DP x PP x TP jobs under 1F1B with faults, emitting what agents emit plus ground truth.

model.py (timing core) · topology.py (GPU -> NIC -> leaf -> spine) · faults.py (fault specs) · output.py (records,
files, truth) · stream.py (emulated agents over real gRPC) · cli.py (`steplens-sim run|stream`).
"""
