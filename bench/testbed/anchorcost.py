"""What the bootstrap's anchors cost the job: per iteration (one optimizer step and one zero_grad), the step
hook of steplens_anchors alone and with its zero_grad wrapper, against the same loop without them; and, for
comparison, a no-op global module forward pre hook (the alternative it did not take) per module call.

One process, no testbed: a one-parameter SGD step and zero_grad (torch's own work is small, so the hooks
show), called from a stack `--depth` frames deep (a script's main -> train -> loop ...). The variants are
switched in and out of torch's hook table and the zero_grad attributes, and interleaved round by round, so
a neighbour's load hits them alike; each figure is the median over `--reps` rounds of `--calls` calls, minus
the bare loop's. Needs torch. ~30 s on the 2-core VM; run it with nothing CPU-heavy beside it
(flock /tmp/steplens-cpu.lock). Prints one JSON line (microseconds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "agent", "bootstrap", "site")


def _at_depth(fn, depth: int):
    return _at_depth(fn, depth - 1) if depth > 0 else fn()


def measure(depth: int = 10, calls: int = 5000, reps: int = 21) -> dict:
    import torch
    from torch.optim import optimizer as torch_optimizer
    sys.path.insert(0, SITE)
    import steplens_anchors as anchors

    torch.set_num_threads(1)
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    opt = torch.optim.SGD([p], lr=0.1)
    seq = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(100)])
    x = torch.zeros(1, 1)
    plain = {c: c.__dict__["zero_grad"] for c in (torch.optim.Optimizer, torch.nn.Module)}
    anchors.install(tempfile.mkdtemp(prefix="sl-anchorcost-"), 1, zero_grad=True)
    wrapped = {c: c.__dict__["zero_grad"] for c in plain}
    hooks = torch_optimizer._global_optimizer_post_hooks
    hook_id = next(k for k, v in hooks.items() if v is anchors._on_optimizer_step)

    def use(step_hook: bool, zero_grad: bool) -> None:
        if step_hook:
            hooks[hook_id] = anchors._on_optimizer_step
        else:
            hooks.pop(hook_id, None)
        for c in plain:
            c.zero_grad = (wrapped if zero_grad else plain)[c]
        anchors._zero_grad = zero_grad

    def iteration():
        opt.step()
        opt.zero_grad(set_to_none=False)

    def timed(fn, n):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        return (time.perf_counter_ns() - t0) / n

    res = {k: [] for k in ("bare", "step_hook", "both", "fwd_bare", "fwd_hook")}
    for _ in range(reps):
        for name, step_hook, zero_grad in (("bare", False, False), ("step_hook", True, False), ("both", True, True)):
            use(step_hook, zero_grad)
            res[name].append(_at_depth(lambda: timed(iteration, calls), depth))
        use(False, False)
        res["fwd_bare"].append(_at_depth(lambda: timed(lambda: seq(x), calls // 10), depth))
        h = torch.nn.modules.module.register_module_forward_pre_hook(lambda mod, args: None)
        res["fwd_hook"].append(_at_depth(lambda: timed(lambda: seq(x), calls // 10), depth))
        h.remove()
    med = {k: statistics.median(v) for k, v in res.items()}
    return {"iteration_us": round(med["bare"] / 1e3, 2),
            "step_hook_us": round((med["step_hook"] - med["bare"]) / 1e3, 2),
            "step_hook_and_zero_grad_us": round((med["both"] - med["bare"]) / 1e3, 2),
            "forward_pre_hook_per_module_call_us": round((med["fwd_hook"] - med["fwd_bare"]) / 101 / 1e3, 3),
            "depth": depth, "anchors_written": anchors._ring.count}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=10, help="frames between the loop and the script's top")
    ap.add_argument("--calls", type=int, default=5000, help="calls per round and variant")
    ap.add_argument("--reps", type=int, default=21, help="rounds")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.depth, a.calls, a.reps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
