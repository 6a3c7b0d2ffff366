"""Progress lines: plain lines when stderr is not a terminal (a CI log, a pipe), an open line on a terminal,
nothing with --quiet; a step or a watched piece of work speaks only once it has run a while."""

import io
import json
import time

from qprep import progress as progress_module
from qprep.optimize import stage as optimize_module
from qprep.optimize.passes import GraphPass, PassOutcome, all_passes
from qprep.progress import Progress
from graphs import tiny_conv_model


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_not_a_terminal_gets_one_plain_line_per_event():
    stream = io.StringIO()
    progress = Progress(stream=stream, long=0.05)
    with progress.step("[2/3] optimize"):
        time.sleep(0.3)
        progress.note("halfway")
    with progress.watch("pass fold"):
        time.sleep(0.3)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "qprep: [2/3] optimize …"
    assert lines[1] == "qprep:   halfway"
    assert lines[2].startswith("qprep: [2/3] optimize: ") and lines[2].endswith(" s")
    assert lines[3].startswith("qprep:   pass fold: running for ")
    assert lines[4].startswith("qprep:   pass fold: done in ")
    assert len(lines) == 5 and stream.getvalue().endswith("\n")


def test_a_quick_step_says_nothing_off_a_terminal_and_quiet_says_nothing_at_all():
    """A quick refusal's one line stays the only line; --quiet (enabled=False) silences notes and long steps."""
    stream = io.StringIO()
    with Progress(stream=stream, long=5.0).step("load model"):
        pass
    assert stream.getvalue() == ""
    quiet = Progress(enabled=False, stream=stream, long=0.01)
    with quiet.step("[1/1] optimize"), quiet.watch("pass fold"):
        quiet.note("halfway")
        time.sleep(0.1)
    assert stream.getvalue() == ""


def test_a_terminal_keeps_the_open_line():
    stream = Terminal()
    with Progress(stream=stream).step("[1/1] optimize"):
        pass
    text = stream.getvalue()
    assert text.startswith("qprep: [1/1] optimize … ") and text.endswith(" s\n") and text.count("\n") == 1


def sleeping_pass(model, settings):
    time.sleep(0.5)
    return PassOutcome(0)


def test_a_long_optimize_pass_says_which_pass_and_for_how_long(tmp_path, save, cli, monkeypatch):
    """In-process run without --quiet (stderr is captured, not a terminal): the slow pass is named, with what it
    does; each pass's time is in the stage's record."""
    passes = {"sleepy": GraphPass("sleepy", sleeping_pass, "sleeps on purpose"), **all_passes()}
    monkeypatch.setattr(optimize_module, "all_passes", lambda: passes)
    monkeypatch.setattr(optimize_module, "selected_passes", lambda options: ["sleepy", "cleanup"])
    monkeypatch.setattr(progress_module, "LONG", 0.1)
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {save(tiny_conv_model())}\noutput_dir: {tmp_path / 'run'}\n"
                      "pipeline: [{optimize: {passes: [cleanup]}}]\n")
    code, _, err = cli("run", config)
    assert code == 0, err
    assert "qprep:   optimize: pass sleepy (sleeps on purpose): running for " in err, err
    assert "qprep:   optimize: pass sleepy (sleeps on purpose): done in " in err, err
    stage = json.loads((tmp_path / "run" / "report.json").read_text())["stages"][0]
    assert {p["pass"]: p["seconds"] for p in stage["passes"]}["sleepy"] >= 0.5


def test_a_quick_step_s_notes_wait_off_a_terminal_and_a_long_step_s_are_said():
    """A refusal or a signal during a quick step stays the one line on stderr (the fault suites assert it): the
    step's notes are said only once the step has run `long` seconds, as the step itself."""
    stream = io.StringIO()
    progress = Progress(stream=stream, long=0.2)
    with progress.step("[1/2] quantize"):
        progress.note("bias correction: 1 layers")
    assert stream.getvalue() == ""
    with progress.step("[2/2] evaluate"):
        time.sleep(0.3)
        progress.note("per-layer error")
    assert "qprep:   per-layer error" in stream.getvalue()
