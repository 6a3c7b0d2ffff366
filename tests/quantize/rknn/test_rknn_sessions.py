"""sessions.py: the builds kept with their simulator runtimes, the pinned one kept however many follow."""

from types import SimpleNamespace

from qprep.quantize.rknn.sessions import Session, Sessions


def kept(released: list) -> tuple[Sessions, tuple, tuple]:
    sessions = Sessions(SimpleNamespace(release=released.append))
    best, last = ("normal", frozenset({"a"})), ("normal", frozenset({"a", "b"}))
    sessions.add(best, Session("rknn best", "runner best", None))
    sessions.add(last, Session("rknn last", "runner last", {"ir_tensors": ["b"]}))
    return sessions, best, last


def test_the_pinned_build_stays_and_the_rest_is_released():
    released = []
    sessions, best, last = kept(released)
    sessions.pin(best)
    sessions.release_unpinned()
    assert released == ["rknn last"] and sessions.keys() == [best] and sessions.pinned == best
    assert best in sessions and sessions[best].runner == "runner best" and sessions.get(last) is None
    sessions.release()
    assert released == ["rknn last", "rknn best"] and sessions.keys() == []


def test_release_keeps_the_runner_asked_for_and_forget_calls_no_worker():
    released = []
    sessions, best, last = kept(released)
    sessions.pin(("kl_divergence", frozenset()))  # pinned but not kept: nothing to keep
    sessions.release(keep="runner last")
    assert released == ["rknn best"] and sessions.keys() == [last]
    sessions.release_unpinned()
    assert released == ["rknn best", "rknn last"]
    sessions, _, _ = kept(released := [])
    sessions.forget()
    assert released == [] and sessions.keys() == []
