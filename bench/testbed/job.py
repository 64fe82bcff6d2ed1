"""One rank of the testbed's training job: torch.distributed (gloo), DP x PP x TP, manual flat gradient all-reduce.

Run once per rank (the testbed starts it inside the rank's host namespace). Rank r = (stage * dp + replica)
* tp + tp_index: the tp ranks of one TP group are consecutive (the testbed puts them on one host), and with
tp = 1 rank r sits on stage r // dp, replica r % dp, as before. Rank r sends activations to the same
tp_index of the next stage (rank r + dp * tp). Each stage is Linear(width)-ReLU-Linear(width); with tp > 1
as a Megatron MLP: the first Linear column-parallel (width / tp output features per rank), the second
row-parallel (width / tp input features), its partial outputs summed by an all-reduce over the TP group in
forward, and the input gradients of the column-parallel layer summed by an all-reduce in backward (`_TPCopy`,
`_TPReduce`). A step runs `micro` micro-batches with a GPipe (all forwards, then all backwards) or 1F1B
schedule, sends with isend (so 1F1B cannot deadlock), then one flat all-reduce of all gradients per DP group
(the dp ranks with the same stage and tp_index; not DDP, which with micro-batches would sync only the first
one), then SGD. Each step appends one JSON line to <state>/steps/rank<r>.jsonl with wall and monotonic
start/end and the split compute / pipeline wait (recv + send completion) / DP all-reduce / TP all-reduce
(`tp_allreduce_seconds`, taken out of compute, fwd and bwd so those keep meaning pure compute).

Faults read by the job: env STEPLENS_TESTBED_GC_STORM=1 and STEPLENS_TESTBED_EXTRA_SYNC=1 at launch, and
at run time the control files <state>/faults/rank<r>.json ({"gc_storm": true}, {"slow": 0.05}: the rank spins on
its CPU for 5 % of its usual step time (a moving average over its steps without the fault, per micro-batch) after
its micro-batches, as a slower device would: the job's steps take ~5 % longer, the others waiting for it; in
<state>/faults/all.json: every rank) and <state>/faults/all.json ({"extra_sync": {"start_step": a, "end_step":
b}}), polled once per step. Extra sync is a world barrier per micro-batch, so every rank must agree on the
steps: hence step numbers, not a flag.
Costs: ~120-140 ms per step on the 2-core machine, 8.4 MB all-reduce and ~0.5 MB stage traffic per step
(DP=2 x PP=2); with tp > 1 the DP all-reduce shrinks by tp and each micro-batch adds two TP all-reduces of
micro_batch_size x width floats (64 KB at the defaults).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time


def hold_in_python(path: str, cache: dict) -> None:
    """The `hold` fault: the rank is stuck in Python (a lock, a sleep) while its control file says hold."""
    while _read_json(path, cache).get("hold"):
        time.sleep(0.05)


def spin(seconds: float) -> None:
    """Busy for `seconds` of wall time (work on the CPU, as a slower device's compute would be)."""
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        for i in range(200):
            x += i * i


def _read_json(path: str, cache: dict) -> dict:
    """The control file's content, re-read only when its mtime changes (one stat per step)."""
    try:
        st = os.stat(path)
    except OSError:
        cache.pop(path, None)
        return {}
    key = (st.st_mtime_ns, st.st_size)
    hit = cache.get(path)
    if hit and hit[0] == key:
        return hit[1]
    try:
        with open(path) as fh:
            val = json.load(fh)
    except (OSError, ValueError):
        val = {}
    cache[path] = (key, val)
    return val


def gc_storm(objects: int) -> None:
    """Churn the allocator and run full collections, as a leaky data loader or a big Python-side batch would."""
    junk = [{"i": i, "t": (i, str(i))} for i in range(objects)]
    del junk
    gc.collect()


def tensor_parallel_mlp(width: int, tp: int, tp_index: int, tp_group, clock: dict, seed: int):
    """Linear(width)-ReLU-Linear(width) split Megatron-style over the TP group; this rank's shard.

    The shards are cut from the same full layers that a tp = 1 stage would build from `seed`, so the TP
    job computes the same function. `clock` accumulates the TP all-reduce wall time ("tp") and main-thread
    CPU time ("tp_cpu") of forward and backward.
    """
    import torch
    import torch.distributed as dist

    if width % tp:
        raise ValueError(f"width {width} is not divisible by tp {tp}")

    def all_reduce(x):
        t0, c0 = time.perf_counter(), time.thread_time()
        dist.all_reduce(x, dist.ReduceOp.SUM, tp_group)
        clock["tp"] += time.perf_counter() - t0
        clock["tp_cpu"] += time.thread_time() - c0
        return x

    class _TPCopy(torch.autograd.Function):
        """Megatron's f: identity forward, all-reduce of the input gradient backward."""
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return all_reduce(g.clone())

    class _TPReduce(torch.autograd.Function):
        """Megatron's g: all-reduce forward (sum of the row-parallel partial outputs), identity backward."""
        @staticmethod
        def forward(ctx, x):
            return all_reduce(x.clone())

        @staticmethod
        def backward(ctx, g):
            return g

    torch.manual_seed(seed)
    full1, full2 = torch.nn.Linear(width, width), torch.nn.Linear(width, width)
    shard = width // tp
    lo, hi = tp_index * shard, (tp_index + 1) * shard

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.col = torch.nn.Linear(width, shard)  # output features lo:hi
            self.row = torch.nn.Linear(shard, width, bias=False)  # input features lo:hi
            self.bias = torch.nn.Parameter(full2.bias.detach().clone())  # added once, after the reduce
            with torch.no_grad():
                self.col.weight.copy_(full1.weight[lo:hi])
                self.col.bias.copy_(full1.bias[lo:hi])
                self.row.weight.copy_(full2.weight[:, lo:hi])

        def forward(self, x):
            h = torch.relu(self.col(_TPCopy.apply(x)))
            return _TPReduce.apply(self.row(h)) + self.bias

    return MLP()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--host", default="", help="the testbed host it runs on (h<i>): read by that host's agent "
                                               "from the command line, unused here")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per stage replica (one host)")
    ap.add_argument("--steps", type=int, default=100, help="0 = until killed")
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    ap.add_argument("--vary-micro", default="", metavar="LO:HI",
                    help="micro-batches per step drawn from LO..HI each step (one seed: every rank draws the same), "
                         "a workload that changes from step to step as packed sequences do")
    ap.add_argument("--toggle-iters", type=int, default=0, metavar="K",
                    help="steplens_iters off and on every K steps (bench/sentinel_cost.py: with vs without, one run)")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--schedule", choices=["gpipe", "1f1b"], default="gpipe")
    ap.add_argument("--timeout-seconds", type=float, default=30.0, help="gloo (backend) timeout")
    ap.add_argument("--gc-objects", type=int, default=100_000,
                    help="objects per GC-storm burst (one burst per step; a full gc.collect() with torch "
                         "loaded alone costs ~0.2 s here)")
    ap.add_argument("--state-dir", required=True)
    a = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    world = a.dp * a.pp * a.tp
    dist.init_process_group("gloo", rank=a.rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout_seconds))
    group_index, tp_index = divmod(a.rank, a.tp)  # group_index = stage * dp + replica
    stage, replica = divmod(group_index, a.dp)

    def rank_of(s: int, d: int, k: int) -> int:
        return (s * a.dp + d) * a.tp + k

    # every rank creates every group, in the same order (new_group is collective over the world)
    dp_groups = {(s, k): dist.new_group([rank_of(s, d, k) for d in range(a.dp)])
                 for s in range(a.pp) for k in range(a.tp)}
    dp_group = dp_groups[(stage, tp_index)]
    tp_group = None
    if a.tp > 1:
        tp_groups = {(s, d): dist.new_group([rank_of(s, d, k) for k in range(a.tp)])
                     for s in range(a.pp) for d in range(a.dp)}
        tp_group = tp_groups[(stage, replica)]
    prev_rank = rank_of(stage - 1, replica, tp_index) if stage > 0 else None
    next_rank = rank_of(stage + 1, replica, tp_index) if stage < a.pp - 1 else None

    clock = {"tp": 0.0, "tp_cpu": 0.0}  # TP all-reduce time, accumulated by the model's autograd functions
    if a.tp > 1:
        model = tensor_parallel_mlp(a.width, a.tp, tp_index, tp_group, clock, seed=1234 + stage)
    else:
        torch.manual_seed(1234 + stage)  # replicas of a stage start equal
        model = torch.nn.Sequential(torch.nn.Linear(a.width, a.width), torch.nn.ReLU(),
                                    torch.nn.Linear(a.width, a.width))
    params = [p for p in model.parameters()]
    opt = torch.optim.SGD(params, lr=1e-3)
    gen = torch.Generator().manual_seed(99 + replica)
    shape = (a.micro_batch_size, a.width)

    os.makedirs(os.path.join(a.state_dir, "steps"), exist_ok=True)
    log = open(os.path.join(a.state_dir, "steps", f"rank{a.rank}.jsonl"), "a", buffering=1)
    ctl_rank = os.path.join(a.state_dir, "faults", f"rank{a.rank}.json")
    ctl_all = os.path.join(a.state_dir, "faults", "all.json")
    env_gc = os.environ.get("STEPLENS_TESTBED_GC_STORM") == "1"
    env_sync = os.environ.get("STEPLENS_TESTBED_EXTRA_SYNC") == "1"
    cache: dict = {}

    import random
    draw = random.Random(4321)
    vary = tuple(int(v) for v in a.vary_micro.split(":")) if a.vary_micro else None
    step = 0
    base_step_s = 0.0
    while a.steps <= 0 or step < a.steps:
        # the step's workload, as locals a sentinel reads at the optimizer step (STEPLENS_STEP_FEATURES)
        micro_batches = draw.randint(*vary) if vary else a.micro
        tokens = micro_batches * a.micro_batch_size
        iters_on = None
        if a.toggle_iters:   # the bootstrap's iteration anchors on in even segments, off in odd ones
            import sys
            mod = sys.modules.get("steplens_iters")
            if mod is not None:
                iters_on = (step // a.toggle_iters) % 2 == 0
                mod.set_enabled(iters_on)
        rank_ctl = _read_json(ctl_rank, cache)
        sync_ctl = _read_json(ctl_all, cache).get("extra_sync") or {}
        if rank_ctl.get("hold"):
            hold_in_python(ctl_rank, cache)
            rank_ctl = _read_json(ctl_rank, cache)
        storm = env_gc or bool(rank_ctl.get("gc_storm"))
        extra_sync = env_sync or (sync_ctl.get("start_step", -1) <= step < sync_ctl.get("end_step", -1))
        t = {"compute": 0.0, "pipe_wait": 0.0, "allreduce": 0.0, "gc": 0.0, "sync": 0.0,
             "fwd": 0.0, "bwd": 0.0, "opt": 0.0, "compute_cpu": 0.0}
        clock["tp"] = clock["tp_cpu"] = 0.0
        pending: list = []
        start_ns, start_mono, start_cpu = time.time_ns(), time.monotonic_ns(), time.process_time()

        def timed(kind, fn, *args, phase=None):
            t0, c0, tp0, tpc0 = time.perf_counter(), time.thread_time(), clock["tp"], clock["tp_cpu"]
            r = fn(*args)
            dt = time.perf_counter() - t0 - (clock["tp"] - tp0)  # TP all-reduces inside count apart
            t[kind] += dt
            if phase:  # compute split (fwd / bwd / opt) and the main thread's CPU time in it
                t[phase] += dt
                t["compute_cpu"] += time.thread_time() - c0 - (clock["tp_cpu"] - tpc0)
            return r

        inputs, outputs = {}, {}

        def forward(m):
            if prev_rank is None:
                x = torch.randn(shape, generator=gen)
            else:
                x = torch.empty(shape)
                timed("pipe_wait", dist.recv, x, prev_rank)
                x.requires_grad_(True)
            y = timed("compute", model, x, phase="fwd")
            inputs[m], outputs[m] = x, y
            if next_rank is not None:
                pending.append(dist.isend(y.detach(), next_rank))
            if extra_sync:
                timed("sync", dist.barrier)

        def backward(m):
            x, y = inputs.pop(m), outputs.pop(m)
            if next_rank is None:
                loss = timed("compute", lambda: (y.float().pow(2).mean()), phase="bwd")
                timed("compute", loss.backward, phase="bwd")
            else:
                g = torch.empty(shape)
                timed("pipe_wait", dist.recv, g, next_rank)
                timed("compute", y.backward, g, phase="bwd")
            if prev_rank is not None:
                pending.append(dist.isend(x.grad, prev_rank))

        if storm:  # once per step, where a data loader would build the batch
            timed("gc", gc_storm, a.gc_objects)
        if a.schedule == "gpipe":
            order = [("f", m) for m in range(micro_batches)] + [("b", m) for m in range(micro_batches)]
        else:
            warm = min(a.pp - stage - 1, micro_batches)
            order = [("f", m) for m in range(warm)]
            for m in range(warm, micro_batches):
                order += [("f", m), ("b", m - warm)]
            order += [("b", m) for m in range(micro_batches - warm, micro_batches)]
        for kind, m in order:
            (forward if kind == "f" else backward)(m)
        for w in pending:
            timed("pipe_wait", w.wait)
        slow = float(rank_ctl.get("slow") or _read_json(ctl_all, cache).get("slow") or 0.0)
        if slow > 0 and base_step_s:  # the `slow` fault: this rank spins `slow` x its usual step per micro-batch
            timed("compute", spin, base_step_s * micro_batches * slow, phase="bwd")   # (a slower device)

        flat = torch.cat([p.grad.reshape(-1) for p in params])
        timed("allreduce", dist.all_reduce, flat, dist.ReduceOp.SUM, dp_group)
        flat /= a.dp
        off = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[off:off + n].view_as(p))
            off += n
        timed("compute", opt.step, phase="opt")
        opt.zero_grad(set_to_none=False)

        end_ns, end_mono = time.time_ns(), time.monotonic_ns()
        log.write(json.dumps({
            "step": step, "rank": a.rank, "stage": stage, "replica": replica, "tp_index": tp_index,
            "tp": a.tp, "pid": os.getpid(),
            "start_ns": start_ns, "end_ns": end_ns, "start_mono_ns": start_mono, "end_mono_ns": end_mono,
            "step_seconds": (end_mono - start_mono) / 1e9, "compute_seconds": t["compute"],
            "pipe_wait_seconds": t["pipe_wait"], "allreduce_seconds": t["allreduce"],
            "tp_allreduce_seconds": clock["tp"],
            "gc_seconds": t["gc"], "sync_seconds": t["sync"], "gc_storm": storm, "extra_sync": extra_sync,
            "fwd_seconds": t["fwd"], "bwd_seconds": t["bwd"], "opt_seconds": t["opt"],
            "compute_cpu_seconds": t["compute_cpu"], "cpu_seconds": time.process_time() - start_cpu,
            "micro_batches": micro_batches, "tokens": tokens, "slow": slow, "iters_on": iters_on,
        }) + "\n")
        step += 1
        if not slow and step > 5:   # the usual step time per micro-batch, from the steps without the fault
            per = (end_mono - start_mono) / 1e9 / micro_batches
            base_step_s = per if not base_step_s else 0.98 * base_step_s + 0.02 * per
    dist.barrier()
    dist.destroy_process_group()
    import sys
    mod = sys.modules.get("steplens_iters")
    if mod is not None and a.toggle_iters:   # the anchors' own time (STEPLENS_ITERS_SELFTIME), for the cost bench
        with open(os.path.join(a.state_dir, "steps", f"iters-status-rank{a.rank}.json"), "w") as fh:
            json.dump(mod.status(), fh)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
