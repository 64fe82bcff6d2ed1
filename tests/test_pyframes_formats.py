"""Stack sample writers: collapsed, speedscope and Chrome trace output of synthetic samples.

The writers are pure formatters of `Sample` lists, so the samples are built here by hand: two active
threads whose stacks change (main -> step -> forward, -> backward, then main -> a checkpoint frame
whose name holds ';' and non-ASCII text), one thread that goes idle for a sample, one always idle.
"""

import io
import json

import pytest

from steplens.agent.pyframes.formats import (FORMATS, SPEEDSCOPE_SCHEMA, write, write_chrome, write_collapsed,
                                             write_speedscope)
from steplens.agent.pyframes.model import Frame, Sample, ThreadStack

PID = 4242
T0 = 5_000_000_000
MS = 1_000_000
INTERVAL_NS = 10 * MS
TIMES = [T0, T0 + 10 * MS, T0 + 20 * MS, T0 + 35 * MS]   # the last gap is longer than the interval
ELAPSED_NS = 35 * MS + INTERVAL_NS

MAIN = Frame("<module>", "<module>", "/srv/train.py", 10)
STEP = Frame("step", "Trainer.step", "/srv/train.py", 20)
FWD5 = Frame("forward", "Model.forward", "/srv/model.py", 5)
FWD6 = Frame("forward", "Model.forward", "/srv/model.py", 6)      # same function, next line
BWD = Frame("backward", "Model.backward", "/srv/model.py", 40)
SAVE = Frame("écrire", "Checkpoint.écrire;λ", "/srv/données/ckpt.py", -1)
RUN = Frame("run", "Thread.run", "/usr/lib/python3.11/threading.py", 982)
WORK = Frame("_worker", "_worker", "/srv/data.py", 33)
WAIT = Frame("wait", "Condition.wait", "/usr/lib/python3.11/threading.py", 327)

MAIN_STACKS = [[FWD5, STEP, MAIN], [FWD6, STEP, MAIN], [BWD, STEP, MAIN], [SAVE, MAIN]]  # innermost first
LOADER_STATES = ["running", "running", "sleeping", "running"]


def make_samples() -> list[Sample]:
    samples = []
    for i, t in enumerate(TIMES):
        main = ThreadStack(100, 0x7F00_0000_1000, "python", True, "running", list(MAIN_STACKS[i]))
        loader = ThreadStack(101, 0x7F00_0000_2000, "data;load\ner", False, LOADER_STATES[i], [WORK, RUN])
        idle = ThreadStack(102, 0x7F00_0000_3000, "pt_autograd_0", False, "sleeping", [WAIT, RUN])
        samples.append(Sample(t, PID, [main, loader, idle]))
    return samples


def render(fn, *args, **kwargs) -> str:
    fh = io.StringIO()
    fn(make_samples(), fh, *args, **kwargs)
    return fh.getvalue()


# -- collapsed -------------------------------------------------------------------------------------

LOADER_LINE = (r"process 4242;thread data\x3bload\ner (101);Thread.run (/usr/lib/python3.11/threading.py:982);"
               r"_worker (/srv/data.py:33)")
MAIN_PREFIX = "process 4242;thread python (100);<module> (/srv/train.py:10)"


def test_collapsed_exact_output():
    assert render(write_collapsed) == (
        f"{LOADER_LINE} 3\n"
        f"{MAIN_PREFIX};Checkpoint.écrire\\x3bλ (/srv/données/ckpt.py) 1\n"
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.backward (/srv/model.py:40) 1\n"
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.forward (/srv/model.py:5) 1\n"
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.forward (/srv/model.py:6) 1\n"
    )


def test_collapsed_include_idle_keeps_idle_threads():
    assert render(write_collapsed, include_idle=True).splitlines() == [
        f"{LOADER_LINE} 4",
        "process 4242;thread pt_autograd_0 (102);Thread.run (/usr/lib/python3.11/threading.py:982);"
        "Condition.wait (/usr/lib/python3.11/threading.py:327) 4",
        f"{MAIN_PREFIX};Checkpoint.écrire\\x3bλ (/srv/données/ckpt.py) 1",
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.backward (/srv/model.py:40) 1",
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.forward (/srv/model.py:5) 1",
        f"{MAIN_PREFIX};Trainer.step (/srv/train.py:20);Model.forward (/srv/model.py:6) 1",
    ]


def test_collapsed_lines_split_like_flamegraph_pl():
    # flamegraph.pl: the count after the last space, frames split on every ';'.
    depths = []
    for line in render(write_collapsed, include_idle=True).splitlines():
        stack, count = line.rsplit(" ", 1)
        assert int(count) > 0
        depths.append(len(stack.split(";")))
    assert depths == [4, 4, 4, 5, 5, 5]


# -- speedscope ------------------------------------------------------------------------------------

def speedscope(include_idle=False) -> dict:
    return json.loads(render(write_speedscope, "train.py", INTERVAL_NS, include_idle=include_idle))


def test_speedscope_structure():
    doc = speedscope()
    assert doc["$schema"] == SPEEDSCOPE_SCHEMA
    assert (doc["name"], doc["activeProfileIndex"], doc["exporter"]) == ("train.py", 0, "steplens")
    frames = doc["shared"]["frames"]
    keys = [(f["name"], f["file"], f.get("line")) for f in frames]
    assert len(keys) == len(set(keys)), "a frame is interned once"
    assert ("Checkpoint.écrire;λ", "/srv/données/ckpt.py", None) in keys
    # one profile per thread that is active at least once; the always idle thread has none
    assert [p["name"] for p in doc["profiles"]] == ["thread python (100)", "thread data;load\ner (101)"]
    for p in doc["profiles"]:
        assert (p["type"], p["unit"]) == ("sampled", "nanoseconds")
        assert len(p["samples"]) == len(p["weights"]) == len(TIMES)
        assert all(0 <= i < len(frames) for stack in p["samples"] for i in stack)
        assert p["weights"] == [10 * MS, 10 * MS, 15 * MS, INTERVAL_NS]
        assert sum(p["weights"]) == p["endValue"] - p["startValue"] == ELAPSED_NS
        assert p["startValue"] == 0


def test_speedscope_stacks_are_outermost_first_and_idle_is_empty():
    doc = speedscope()
    frames = doc["shared"]["frames"]
    main, loader = doc["profiles"]

    def names(stack):
        return [frames[i]["name"] for i in stack]

    assert [names(s) for s in main["samples"]] == [
        ["<module>", "Trainer.step", "Model.forward"], ["<module>", "Trainer.step", "Model.forward"],
        ["<module>", "Trainer.step", "Model.backward"], ["<module>", "Checkpoint.écrire;λ"]]
    assert main["samples"][0][2] != main["samples"][1][2], "lines 5 and 6 are distinct frames"
    assert [names(s) for s in loader["samples"]] == [
        ["Thread.run", "_worker"], ["Thread.run", "_worker"], [], ["Thread.run", "_worker"]]


def test_speedscope_include_idle():
    doc = speedscope(include_idle=True)
    assert [p["name"] for p in doc["profiles"]] == [
        "thread python (100)", "thread data;load\ner (101)", "thread pt_autograd_0 (102)"]
    assert all(stack for p in doc["profiles"] for stack in p["samples"])


# The fields the writer uses, as https://www.speedscope.app/file-format-schema.json defines them.
SPEEDSCOPE_MINIMAL_SCHEMA = {
    "type": "object",
    "required": ["$schema", "shared", "profiles"],
    "properties": {
        "$schema": {"const": SPEEDSCOPE_SCHEMA},
        "name": {"type": "string"},
        "activeProfileIndex": {"type": "number"},
        "exporter": {"type": "string"},
        "shared": {
            "type": "object", "required": ["frames"],
            "properties": {"frames": {"type": "array", "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "file": {"type": "string"},
                               "line": {"type": "number"}, "col": {"type": "number"}}}}},
        },
        "profiles": {"type": "array", "items": {
            "type": "object",
            "required": ["type", "name", "unit", "startValue", "endValue", "samples", "weights"],
            "additionalProperties": False,
            "properties": {
                "type": {"const": "sampled"},
                "name": {"type": "string"},
                "unit": {"enum": ["none", "nanoseconds", "microseconds", "milliseconds", "seconds", "bytes"]},
                "startValue": {"type": "number"},
                "endValue": {"type": "number"},
                "samples": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
                "weights": {"type": "array", "items": {"type": "number"}},
            }}},
    },
}


def test_speedscope_validates_against_schema():
    jsonschema = pytest.importorskip("jsonschema")
    for include_idle in (False, True):
        jsonschema.validate(speedscope(include_idle), SPEEDSCOPE_MINIMAL_SCHEMA)


# -- chrome ----------------------------------------------------------------------------------------

def chrome(include_idle=False) -> dict:
    return json.loads(render(write_chrome, INTERVAL_NS, include_idle=include_idle))


def events_by_thread(doc) -> dict[int, list[dict]]:
    by_tid: dict[int, list[dict]] = {}
    for ev in doc["traceEvents"]:
        if ev["ph"] in "BE":
            assert ev["pid"] == PID
            by_tid.setdefault(ev["tid"], []).append(ev)
    return by_tid


def walk(events) -> list[tuple[str, float, float]]:
    """Replay B/E events like a trace viewer: (name, begin, end) of each outermost event."""
    stack, outermost = [], []
    last_ts = float("-inf")
    for ev in events:
        assert ev["ts"] >= last_ts, "timestamps do not go back within a thread"
        last_ts = ev["ts"]
        if ev["ph"] == "B":
            stack.append(ev)
        else:
            assert stack, f"E {ev['name']} with nothing open"
            top = stack.pop()
            assert top["name"] == ev["name"], f"closed {ev['name']} while {top['name']} is on top"
            if not stack:
                outermost.append((top["name"], top["ts"], ev["ts"]))
    assert not stack, "every B has its E"
    return outermost


@pytest.mark.parametrize("include_idle", [False, True])
def test_chrome_events_nest_and_cover_the_sampled_time(include_idle):
    doc = chrome(include_idle)
    assert doc["displayTimeUnit"] == "ms"
    by_tid = events_by_thread(doc)
    assert sorted(by_tid) == ([100, 101, 102] if include_idle else [100, 101])
    samples = make_samples()
    weights_us = [(b - a) / 1000 for a, b in zip(TIMES, TIMES[1:])] + [INTERVAL_NS / 1000]
    for tid, events in by_tid.items():
        outermost = walk(events)
        # the time of every sample in which the thread was shown with a stack
        shown_us = sum(w for s, w in zip(samples, weights_us)
                       for t in s.threads if t.tid == tid and (include_idle or t.active) and t.frames)
        assert sum(end - begin for _, begin, end in outermost) == pytest.approx(shown_us)
    assert walk(by_tid[100]) == [("<module>", 0.0, ELAPSED_NS / 1000)]
    if not include_idle:
        assert walk(by_tid[101]) == [("Thread.run", 0.0, 20_000.0), ("Thread.run", 35_000.0, 45_000.0)]


def test_chrome_frames_compare_by_function_not_line():
    main = events_by_thread(chrome())[100]
    opened = [(ev["name"], ev["ts"], ev["args"]["line"]) for ev in main if ev["ph"] == "B"]
    assert opened == [("<module>", 0.0, 10), ("Trainer.step", 0.0, 20), ("Model.forward", 0.0, 5),
                      ("Model.backward", 20_000.0, 40), ("Checkpoint.écrire;λ", 35_000.0, -1)]
    closed = [(ev["name"], ev["ts"]) for ev in main if ev["ph"] == "E"]
    assert closed == [("Model.forward", 20_000.0), ("Model.backward", 35_000.0), ("Trainer.step", 35_000.0),
                      ("Checkpoint.écrire;λ", 45_000.0), ("<module>", 45_000.0)]
    assert main[0]["args"]["file"] == "/srv/train.py"


def test_chrome_metadata_names_process_and_threads():
    meta = [ev for ev in chrome()["traceEvents"] if ev["ph"] == "M"]
    assert [(ev["name"], ev["pid"], ev["args"]["name"]) for ev in meta] == [
        ("process_name", PID, "process 4242"),
        ("thread_name", PID, "thread python (100)"),
        ("thread_name", PID, "thread data;load\ner (101)")]
    assert [ev["tid"] for ev in meta[1:]] == [100, 101]


def test_thread_that_leaves_closes_its_frames():
    samples = make_samples()
    samples[2].threads = [t for t in samples[2].threads if t.tid != 100]  # main missing from one sample
    fh = io.StringIO()
    write_chrome(samples, fh, INTERVAL_NS)
    assert walk(events_by_thread(json.loads(fh.getvalue()))[100]) == [
        ("<module>", 0.0, 20_000.0), ("<module>", 35_000.0, 45_000.0)]


# -- shared ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_output_is_deterministic_and_independent_of_input_order(fmt):
    outputs = set()
    for samples in (make_samples(), make_samples(), list(reversed(make_samples()))):
        fh = io.StringIO()
        write(samples, fh, fmt, name="x", interval_ns=INTERVAL_NS)
        outputs.add(fh.getvalue())
    assert len(outputs) == 1


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_samples_is_a_valid_empty_document(fmt):
    fh = io.StringIO()
    write([], fh, fmt, interval_ns=INTERVAL_NS)
    if fmt == "collapsed":
        assert fh.getvalue() == ""
    else:
        doc = json.loads(fh.getvalue())
        assert doc.get("profiles", doc.get("traceEvents")) == []


def test_write_dispatches_to_the_writers():
    fh = io.StringIO()
    write(make_samples(), fh, "collapsed", include_idle=True)
    assert fh.getvalue() == render(write_collapsed, include_idle=True)
    fh = io.StringIO()
    write(make_samples(), fh, "speedscope", name="train.py", interval_ns=INTERVAL_NS)
    assert fh.getvalue() == render(write_speedscope, "train.py", INTERVAL_NS)
    fh = io.StringIO()
    write(make_samples(), fh, "chrome", interval_ns=INTERVAL_NS)
    assert fh.getvalue() == render(write_chrome, INTERVAL_NS)


def test_write_rejects_unknown_format_before_writing():
    fh = io.StringIO()
    with pytest.raises(ValueError, match="bogus"):
        write(make_samples(), fh, "bogus")
    assert fh.getvalue() == ""


@pytest.mark.parametrize("interval_ns", [None, 0, -5, 1.5, True])
@pytest.mark.parametrize("fmt", ["speedscope", "chrome"])
def test_timed_formats_need_a_positive_interval(fmt, interval_ns):
    fh = io.StringIO()
    with pytest.raises(ValueError, match="interval_ns"):
        write(make_samples(), fh, fmt, interval_ns=interval_ns)
    assert fh.getvalue() == ""
