"""The findings lifecycle (collector/analysis/findings.merge): identity, update, `for`, resolve, as a pure function."""

from dataclasses import replace

import pytest

from steplens.collector.analysis.findings import Change, Finding, Policy, Suspect, merge

S = 10**9
P = Policy(for_ns=0, resolve_after_ns=60 * S)


def emitted(t_ns: int, rank: str = "13", severity: float = 1.5, kind: str = "slowdown", onset_ns: int | None = None,
            detector: str = "gate") -> Finding:
    return Finding(kind=kind, onset_ns=onset_ns if onset_ns is not None else t_ns - 5 * S, last_ns=t_ns,
                   severity=severity, summary=f"rank {rank} slow", job_key="job", detector=detector,
                   suspects=(Suspect("rank", rank, 0.9, "compute", {"z": 4.0}), Suspect("node", "n1", 0.1)),
                   evidence={"steps": [1, 2]})


def apply(store: dict, changes: list[Change]) -> dict:
    """What the store does with the changes (insert/update by id, delete dropped)."""
    for c in changes:
        if c.action == "dropped":
            store.pop(c.finding.id, None)
        else:
            store[c.finding.id] = c.finding
    return store


def live(store: dict) -> list[Finding]:
    return [f for f in store.values() if f.status in ("pending", "open")]


def test_open_update_resolve():
    store: dict = {}
    ch = merge([], [emitted(100 * S)], 100 * S, P)
    assert [c.action for c in ch] == ["opened"]
    f = ch[0].finding
    assert f.status == "open" and f.onset_ns == 95 * S and f.last_ns == 100 * S and f.id and f.confirmations == 1
    apply(store, ch)
    # re-confirmed: same id, last_ns and severity move, onset stays, peak kept
    ch = merge(live(store), [emitted(110 * S, severity=2.0, onset_ns=104 * S)], 110 * S, P)
    assert [c.action for c in ch] == ["updated"]
    g = ch[0].finding
    assert (g.id, g.onset_ns, g.last_ns, g.severity, g.peak_severity, g.confirmations) == \
        (f.id, 95 * S, 110 * S, 2.0, 2.0, 2)
    apply(store, ch)
    ch = merge(live(store), [emitted(120 * S, severity=1.2)], 120 * S, P)
    assert ch[0].finding.severity == 1.2 and ch[0].finding.peak_severity == 2.0
    apply(store, ch)
    # not re-confirmed, but within the persistence period: nothing changes
    assert merge(live(store), [], 170 * S, P) == []
    # 60 s of data time without confirmation: resolved at the window end
    ch = merge(live(store), [], 180 * S, P)
    assert [c.action for c in ch] == ["resolved"]
    assert ch[0].finding.status == "resolved" and ch[0].finding.resolved_ns == 180 * S and ch[0].finding.id == f.id
    apply(store, ch)
    assert live(store) == []
    # the same fault later is a new finding (new onset, new id)
    ch = merge(live(store), [emitted(300 * S)], 300 * S, P)
    assert ch[0].action == "opened" and ch[0].finding.id != f.id


def test_identity_is_job_detector_kind_and_top_suspect():
    a = merge([], [emitted(100 * S, rank="13"), emitted(100 * S, rank="7"),
                   emitted(100 * S, rank="13", kind="spike"), emitted(100 * S, rank="13", detector="other")],
              100 * S, P)
    assert len({c.finding.id for c in a}) == 4 and all(c.action == "opened" for c in a)
    # several outputs with one identity in one window: the most severe of those still going on stands
    b = merge([], [emitted(100 * S, severity=1.3), emitted(100 * S, severity=1.9)], 100 * S, P)
    assert len(b) == 1 and b[0].finding.severity == 1.9
    b = merge([], [emitted(100 * S, severity=1.9), emitted(130 * S, severity=1.3)], 130 * S, P)   # both going on
    assert len(b) == 1 and b[0].finding.severity == 1.9
    # an earlier, worse episode that is over does not hide a new one (the sentinel reports both while both lie in
    # its window): the new one opens once the old one has resolved, and is not taken for it
    store = apply({}, merge([], [emitted(100 * S, severity=7.2)], 100 * S, P))
    store = apply(store, merge(live(store), [emitted(100 * S, severity=7.2)], 170 * S, P))
    assert live(store) == []   # resolved: nothing newer came
    ch = merge(live(store), [emitted(100 * S, severity=7.2), emitted(180 * S, severity=2.7)], 180 * S, P)
    assert [(c.action, c.finding.severity, c.finding.last_ns) for c in ch] == [("opened", 2.7, 180 * S)]
    # no suspect at all is an identity too
    c = merge([], [replace(emitted(100 * S), suspects=())], 100 * S, P)
    assert c[0].finding.key[3:] == ("", "")


def test_an_episode_reported_and_resolved_is_not_stored_again_while_the_window_holds_it():
    """The sentinel reports every episode still in its 60 s window: once its finding resolved, the same episode
    seen again is not a second finding (it was one before: each sentinel finding came twice on the inference bed,
    the second stored as history with a later onset); an operator's diagnose (confirm) still gets it."""
    def unread():
        raise AssertionError("resolved findings read where no output is over")
    store = apply({}, merge([], [emitted(100 * S, onset_ns=90 * S)], 100 * S, P, resolved=unread))
    (first,) = [f for f in store.values()]
    ch = merge(live(store), [emitted(100 * S, onset_ns=90 * S)], 170 * S, P)
    assert [c.action for c in ch] == ["resolved"]
    store = apply(store, ch)
    resolved = [f for f in store.values() if f.status == "resolved"]
    again = emitted(100 * S, onset_ns=95 * S)   # the same episode, its onset as the window now sees it
    assert merge(live(store), [again], 175 * S, P, resolved=lambda: resolved) == []
    assert [c.action for c in merge(live(store), [again], 175 * S, P)] == ["resolved"]   # without: history again
    assert [c.action for c in merge(live(store), [again], 175 * S, P, confirm=True, resolved=lambda: resolved)] == \
        ["resolved"]
    # a new episode after it is a new finding
    ch = merge(live(store), [again, emitted(180 * S, onset_ns=176 * S)], 180 * S, P, resolved=lambda: resolved)
    assert [(c.action, c.finding.onset_ns) for c in ch] == [("opened", 176 * S)] and ch[0].finding.id != first.id


def test_other_findings_are_left_alone():
    store = apply({}, merge([], [emitted(100 * S, rank="13"), emitted(100 * S, rank="7")], 100 * S, P))
    ch = merge(live(store), [emitted(130 * S, rank="7")], 130 * S, P)
    assert [(c.action, c.finding.suspects[0].id) for c in ch] == [("updated", "7")]
    ch = merge(live(apply(store, ch)), [emitted(170 * S, rank="7")], 170 * S, P)
    assert sorted((c.action, c.finding.suspects[0].id) for c in ch) == [("resolved", "13"), ("updated", "7")]


def test_for_keeps_it_pending_until_confirmed_long_enough():
    pol = Policy(for_ns=30 * S, resolve_after_ns=60 * S)
    store: dict = {}
    ch = merge([], [emitted(100 * S)], 100 * S, pol)
    assert [(c.action, c.finding.status) for c in ch] == [("pending", "pending")]
    apply(store, ch)
    ch = merge(live(store), [emitted(115 * S)], 115 * S, pol)
    assert [(c.action, c.finding.status) for c in ch] == [("pending", "pending")]
    apply(store, ch)
    ch = merge(live(store), [emitted(130 * S)], 130 * S, pol)
    assert [(c.action, c.finding.status) for c in ch] == [("opened", "open")]
    assert ch[0].finding.onset_ns == 95 * S and ch[0].finding.confirmations == 3


def test_pending_not_confirmed_is_dropped():
    pol = Policy(for_ns=30 * S, resolve_after_ns=60 * S)
    store = apply({}, merge([], [emitted(100 * S)], 100 * S, pol))
    ch = merge(live(store), [], 110 * S, pol)
    assert [c.action for c in ch] == ["dropped"]
    assert apply(store, ch) == {}


def test_confirm_opens_at_once():
    pol = Policy(for_ns=300 * S, resolve_after_ns=60 * S)
    ch = merge([], [emitted(100 * S)], 100 * S, pol, confirm=True)
    assert ch[0].action == "opened" and ch[0].finding.status == "open"
    pending = merge([], [emitted(100 * S)], 100 * S, pol)[0].finding
    ch = merge([pending], [emitted(105 * S)], 105 * S, pol, confirm=True)
    assert ch[0].action == "opened"


def test_an_old_event_in_the_window_confirms_nothing():
    # a window reaching back over an event that ended long before the newest data: history, not open
    ch = merge([], [emitted(100 * S)], 400 * S, P, confirm=True)
    assert [(c.action, c.finding.status, c.finding.resolved_ns) for c in ch] == [("resolved", "resolved", 400 * S)]
    assert merge([], [emitted(100 * S)], 400 * S, Policy(for_ns=10 * S, resolve_after_ns=60 * S)) == []
    store = apply({}, merge([], [emitted(100 * S)], 100 * S, P))
    ch = merge(live(store), [emitted(100 * S)], 200 * S, P)
    assert [c.action for c in ch] == ["resolved"]


def test_json_shape():
    f = merge([], [emitted(100 * S)], 100 * S, P)[0].finding.to_json()
    assert {"id", "job_key", "kind", "detector", "status", "onset_ns", "last_ns", "severity", "summary", "suspects",
            "evidence"} <= set(f)
    assert f["suspects"][0] == {"kind": "rank", "id": "13", "score": 0.9, "cause": "compute", "evidence": {"z": 4.0}}


def test_suspect_kind_is_checked():
    with pytest.raises(ValueError, match="suspect kind"):
        Suspect("cpu", "x")
