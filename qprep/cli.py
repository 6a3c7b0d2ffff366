"""Command line: argument parsing only; everything else is the library.

Exit codes: 0 ok, 1 accuracy gate missed, 2 usage/config/input error, 3 internal error.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import traceback
from pathlib import Path

from qprep.errors import (
    EXIT_GATE_MISSED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    InterruptOnce,
    Problems,
    QprepError,
    signal_handlers,
)
from qprep.version import __version__


def build_parser() -> argparse.ArgumentParser:
    """The `qprep` command line: each subcommand's arguments come from its `_add_<command>`, in `--help`'s
    order (bash completion reads them from this parser too)."""
    parser = argparse.ArgumentParser(
        prog="qprep", description="Prepare ONNX models for INT8 deployment (ONNX Runtime, RKNN, FP16) and "
                                  "report the accuracy lost against the float model.")
    parser.add_argument("--version", action="version", version=f"qprep {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_run(sub)
    _add_validate(sub)
    _add_inspect(sub)
    _add_init(sub)
    _add_batch(sub)
    _add_compare(sub)
    _add_evaluate(sub)
    _add_setup(sub)
    _add_completion(sub)
    _add_config(sub)
    return parser


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run a config's pipeline on one model",
                         description="Run the stages a YAML config lists and write a run directory "
                                     "(model.onnx, report.json/md, manifest.json, qprep.log).")
    run.add_argument("config", type=_input("the config"), help="YAML config file")
    run.add_argument("--model", type=_input("the model"),
                     help="input model (overrides `model:`; relative to the current directory)")
    run.add_argument("--out", type=_output_folder("--out"), help="run directory (overrides `output_dir:`)")
    run.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key, e.g. calibration.max_samples=16 or pipeline.quantize.backend=ort")
    run.add_argument("--overlay", type=_input("the overlay"), metavar="FILE",
                     help="a YAML file merged over the config (paths relative to it), "
                          "e.g. one model's input dims and samples")
    run.add_argument("--force", action="store_true", help="replace a previous run in a non-empty run directory")
    run.add_argument("--strict", action="store_true", help="exit 2 when any rewrite was rolled back")
    _common(run)


def _add_validate(sub) -> None:
    validate = sub.add_parser("validate", help="check a config (keys, types, files) without running it")
    validate.add_argument("config", type=_input("the config"), help="YAML config file")
    validate.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                          help="override a config key, as in `run`")
    validate.add_argument("--overlay", type=_input("the overlay"), metavar="FILE",
                          help="a YAML file merged over the config")
    _common(validate)


def _add_inspect(sub) -> None:
    inspect = sub.add_parser("inspect", help="describe a model: kind, inputs/outputs, op histogram, opsets")
    inspect.add_argument("model", type=_input("the model"), help="the ONNX model")
    inspect.add_argument("--json", action="store_true", help="print JSON for machines")
    _common(inspect)


def _add_init(sub) -> None:
    init = sub.add_parser("init", help="write a commented starter config for a model",
                          description="Reads the model (inputs, dims, layout, whether it normalizes its input, "
                                      "LayerNorms, output kinds) and, with --data, the sample folders, and writes "
                                      "a config to review and run.")
    init.add_argument("model", type=_input("the model"), help="the ONNX model")
    init.add_argument("--backend", choices=("ort", "rknn", "fp16"), default="ort",
                      help="ort: ONNX Runtime INT8 (default); rknn: Rockchip NPU; fp16: float16")
    init.add_argument("--data", type=_input("the data folder"),
                      help="folder of samples, or holding calib/ eval/ heldout/ folders")
    init.add_argument("--out", type=_output_file("--out"), help="config file to write (default: ./<model name>.yaml)")
    init.add_argument("--force", action="store_true", help="replace an existing config file")
    _common(init)


def _add_batch(sub) -> None:
    batch = sub.add_parser("batch", help="run one config over every .onnx model in a folder",
                           description="Each model runs in its own process and run directory under --out, on "
                                       "this machine or as a Ray task (--executor ray); "
                                       "summary.json/csv/md/html list them worst first. A NAME.qprep.yaml beside "
                                       "NAME.onnx is merged over the config for that model (run --overlay). "
                                       "Exit 2 if any model failed, else 1 if any missed its gate.")
    batch.add_argument("config", type=_input("the config"),
                       help="YAML config applied to every model (its `model:` is replaced)")
    batch.add_argument("folder", type=_input("the models folder"), help="folder of .onnx models")
    batch.add_argument("--out", required=True, type=_output_folder("--out"),
                       help="batch directory (one run directory per model)")
    batch.add_argument("--jobs", type=int, help="local executor: worker processes (default: from cores, threads "
                                                "and memory)")
    batch.add_argument("--executor", choices=("local", "ray"), default="local",
                       help="local: processes on this machine (default); ray: one Ray task per model on a Ray "
                            "cluster (pip install 'qprep[ray]')")
    batch.add_argument("--address", help="ray executor: the cluster to join (`auto` for the one `ray start` "
                                         "began here, ray://HOST:10001 for a remote head); default: start a Ray "
                                         "instance on this machine for the batch")
    batch.add_argument("--recursive", action="store_true", help="also models in sub-folders")
    batch.add_argument("--resume", action="store_true", help="skip models whose run directory holds a complete "
                                                             "result for the same model and config")
    batch.add_argument("--timeout", type=float, help="seconds per model before it counts as failed")
    batch.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                       help="override a config key for every model, as in `run`")
    _common(batch)


def _add_compare(sub) -> None:
    compare = sub.add_parser("compare", help="compare runs (INT8 vs FP32, run vs run, batch vs batch)")
    compare.add_argument("runs", nargs="+", type=_input("the compared run"),
                         help="run directories, report.json or summary.json files")
    compare.add_argument("--fail-on-regression", action="append", default=[], metavar="METRIC=THRESHOLD",
                         help="exit 1 when a later run is worse than the first by more than THRESHOLD")
    compare.add_argument("--markdown", type=_output_file("--markdown"),
                         help="also write the table as Markdown to this file")
    compare.add_argument("--html", type=_output_file("--html"), help="also write the table as HTML to this file")
    _common(compare)


def _add_evaluate(sub) -> None:
    evaluate = sub.add_parser("evaluate", help="measure a finished run's result again on other (held-out) samples",
                              description="Re-runs the run's evaluation (its reference, input fixes, metrics, "
                                          "tasks and gate, from manifest.json) on another sample folder; the run "
                                          "directory is not touched. Exit 1 if the gate is missed on them.")
    evaluate.add_argument("run_dir", type=_input("the run directory"),
                          help="run directory of a finished run (ONNX result)")
    evaluate.add_argument("--samples", required=True, type=_input("the samples"),
                          help="folder (or list file) of samples, as evaluation.source")
    evaluate.add_argument("--labels", type=_input("the labels"),
                          help="ground-truth labels for these samples (as evaluation.labels)")
    evaluate.add_argument("--json", dest="json_out", type=_output_file("--json"), metavar="FILE",
                          help="also write the result as JSON")
    evaluate.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                          help="override an evaluation key, e.g. evaluation.max_samples=16")
    _common(evaluate)


def _add_setup(sub) -> None:
    setup = sub.add_parser("setup", help="install an optional backend's toolkit into this environment",
                           description="rknn: rknn-toolkit2 2.5.0 with its pins (numpy 1.26.4, onnx 1.18.0, "
                                       "protobuf 4.25.4, onnxruntime 1.26.0), its dependencies without torch's CUDA "
                                       "build, and a CPU torch if none is installed (CPython 3.11/3.12).")
    setup.add_argument("backend", choices=["rknn"], help="the backend to install (rknn)")
    setup.add_argument("--torch", default="torch", metavar="SPEC",
                       help="the torch requirement when none is installed (default: torch)")
    setup.add_argument("--torch-index", default=None, metavar="URL",
                       help="index to take torch from (default: PyTorch's CPU wheels, "
                            "https://download.pytorch.org/whl/cpu; '' = pip's configured index)")
    setup.add_argument("--dry-run", action="store_true", help="print the pip commands without running them")
    _common(setup)


def _add_completion(sub) -> None:
    completion = sub.add_parser("completion", help="print a shell completion script",
                                description='bash (zsh with bashcompinit): eval "$(qprep completion bash)" in ~/.bashrc')
    completion.add_argument("shell", choices=["bash"], help="the shell (bash; zsh through bashcompinit)")


def _add_config(sub) -> None:
    config = sub.add_parser("config", help="show the config reference")
    config.add_argument("--schema", action="store_true", help="every key with its type, default and meaning")
    _common(config)


def _input(option: str):
    from qprep.disk.guard import INPUT, path_arg

    return path_arg(INPUT, option)


def _output_file(option: str):
    from qprep.disk.guard import OUTPUT_FILE, path_arg

    return path_arg(OUTPUT_FILE, option)


def _output_folder(option: str):
    from qprep.disk.guard import OUTPUT_FOLDER, path_arg

    return path_arg(OUTPUT_FOLDER, option)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks")
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def main(argv: list[str] | None = None) -> int:
    from qprep.pipeline.batch_worker import die_with_parent

    die_with_parent()  # a batch worker ends with the process that started it
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return EXIT_USAGE
    # The first Ctrl-C, SIGTERM or SIGHUP unwinds (the run still writes its report, a batch its summary); the
    # ones after it only say so: a second Ctrl-C 30 ms later must not cut that short.
    once = InterruptOnce(_say_stopping)
    try:
        with signal_handlers(once, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, keep=lambda: once.fired):
            return _dispatch(args)
    finally:
        if once.fired:  # exiting after an interrupt: ignored, as Python's shutdown would put back SIG_DFL for a
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # handler, and a late Ctrl-C kill it (-2)
                signal.signal(sig, signal.SIG_IGN)


def entry() -> None:
    """The `qprep` command (console script, `python -m qprep`): main, then the exit with interrupts ignored.
    Why: Python's shutdown puts SIG_DFL back for a handler, so a Ctrl-C in it killed a run that had finished
    and said so (exit -2, a KeyboardInterrupt traceback); main itself restores the handlers it found, for
    callers in the same process."""
    code = main()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(code)


def _say_stopping() -> None:
    print("qprep: stopping: writing what the first interrupt left to write (report, summary)", file=sys.stderr,
          flush=True)


def _dispatch(args) -> int:
    from qprep.disk.guard import Guard

    try:
        # Every path the command writes is checked against every path it reads before it starts; the command
        # writes through args.guard, which checks again against inputs it learns later (qprep/disk/guard.py).
        args.guard, outputs = Guard.of_args(args)
        args.guard.check(outputs)
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # a closed pipe shows here, inside the try, not at interpreter exit
        return code
    except BrokenPipeError:
        return _reader_gone()
    except QprepError as exc:
        if args.debug:
            traceback.print_exc()
        print(f"qprep: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"qprep: interrupted by {signal.Signals(signum).name}; files already written are complete, nothing "
              "half-written was left (a run's report.json says where it stopped)", file=sys.stderr)
        return 128 + signum
    except PermissionError as exc:  # a file or folder of the user's this user may not read or write: not a bug
        if args.debug:
            traceback.print_exc()
        print(f"qprep: error: permission denied: {exc.filename or exc}; give this user access to it or choose "
              "another path", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - the CLI is the last place to turn a bug into a clear line
        if args.debug:
            traceback.print_exc()
        if isinstance(exc, RuntimeError) and str(exc).startswith("Symlink loop"):  # pathlib, on a user's link
            print(f"qprep: error: {str(exc).splitlines()[0]}; fix or remove the link", file=sys.stderr)
            return EXIT_USAGE
        print(f"qprep: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              "(rerun with --debug for the traceback and please report it)", file=sys.stderr)
        return EXIT_INTERNAL


def _reader_gone() -> int:
    """`qprep inspect M | head -1`: the reader closed the pipe. Stop quietly like a Unix tool killed by SIGPIPE
    (exit 128 + 13); stdout goes to /dev/null so Python's flush at exit cannot raise again (Python docs,
    "Note on SIGPIPE")."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def _overrides(args) -> dict:
    from qprep.config import run_overrides

    return run_overrides(args.sets, getattr(args, "model", None), getattr(args, "out", None))


def cmd_run(args) -> int:
    from qprep.config import load_config
    from qprep.pipeline.runner import execute

    config = load_config(args.config, _overrides(args), overlay=args.overlay)
    report = execute(config, force=args.force, quiet=args.quiet)
    rolled_back = [s["name"] for s in report["stages"] if s.get("rolled_back")]
    if not args.quiet:
        deployed = (report["result"].get("deployable") or report["result"])["path"]  # RKNN's: the .rknn
        print(f"qprep: {report['status']}: {deployed} in {report['run_dir']} "
              f"({report['model']['nodes']} → {report['result']['nodes']} nodes, {report['seconds']:.1f} s)")
        if not report.get("evaluation"):
            print("qprep: accuracy not measured: the config has no `evaluation:` section")
        from qprep.report.verdict import closing_line

        met = closing_line(report)  # what "met" cost: integer share, speed against FP32
        if met:
            print(f"qprep: {met}", file=sys.stderr if met.startswith("warning:") else sys.stdout)
            if met.startswith("warning:"):  # mostly float: what made it so and the setting that changes it
                from qprep.report.float_nodes import mostly_float_text

                cause = mostly_float_text(report).replace("`", "")
                if cause:
                    print(f"qprep: {cause}", file=sys.stderr)
        warnings = report.get("warnings", [])
        for warning in warnings[:MAX_TERMINAL_WARNINGS]:
            print(f"qprep: warning: {warning}", file=sys.stderr)
        if len(warnings) > MAX_TERMINAL_WARNINGS:
            print(f"qprep: {len(warnings) - MAX_TERMINAL_WARNINGS} more warnings in report.md", file=sys.stderr)
    if args.strict and rolled_back:
        print(f"qprep: error: --strict: rewrites were rolled back in {', '.join(rolled_back)} (see report.md)",
              file=sys.stderr)
        return EXIT_USAGE
    gate = (report.get("evaluation") or {}).get("gate")
    if gate and not gate["passed"]:
        from qprep.report.verdict import missed_text, next_step

        what = "accuracy floor" if gate.get("source") == "floor" else "gate"
        worst = f"; worst: {', '.join(gate['worst_tensors'][:4])}" if gate.get("worst_tensors") else ""
        print(f"qprep: {what} missed: {missed_text(report['evaluation'])}{worst} (report in {report['run_dir']})",
              file=sys.stderr)

        step = next_step(report)
        if step:
            print(f"qprep: {step}", file=sys.stderr)
        return EXIT_GATE_MISSED
    return EXIT_OK


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def cmd_validate(args) -> int:
    """The checks `run` makes before it touches the run directory (qprep/preflight.py), and nothing else; their
    warnings too (a setting the samples leave unread), as run shows them."""
    from qprep.config import load_config
    from qprep.pipeline.preflight import check

    config = load_config(args.config, _overrides(args), overlay=args.overlay)
    try:
        checked = check(config, every_problem=True)
    except Problems as found:  # every problem, one line each; the dispatcher would show the first only
        for problem in found.all:
            print(f"qprep: error: {problem}", file=sys.stderr)
        return found.exit_code
    stages = ", ".join(name for name, _ in config.stages) or "no stages"
    if not args.quiet:
        print(f"qprep: {args.config} is valid ({stages})")
        for warning in checked.warnings:
            print(f"qprep: warning: {warning}", file=sys.stderr)
    return EXIT_OK


def cmd_inspect(args) -> int:
    from qprep import jsonfile
    from qprep.inspection import inspect_model, render_inspection

    info = inspect_model(args.model)
    print(jsonfile.dumps(info) if args.json else render_inspection(info))
    return EXIT_OK


def cmd_init(args) -> int:
    from qprep.starter import what_to_review, write_starter

    out, text = write_starter(args.model, args.out or f"{Path(args.model).stem}.yaml", args.backend, args.data,
                              args.force, args.guard)
    if not args.quiet:
        print(f"qprep: wrote {out}: {what_to_review(text)}, then `qprep validate {out}` and `qprep run {out}`")
    return EXIT_OK


def cmd_setup(args) -> int:
    from qprep.quantize.rknn import install

    index = install.TORCH_CPU_INDEX if args.torch_index is None else args.torch_index
    install.install(torch=args.torch, torch_index=index, dry_run=args.dry_run,
                    say=(lambda line: None) if args.quiet else print)
    return EXIT_OK


def cmd_completion(args) -> int:
    from qprep.completion import bash_script

    print(bash_script(build_parser()), end="")
    return EXIT_OK


def cmd_config(args) -> int:
    from qprep.config import SCHEMA
    from qprep.schema import reference
    from qprep.stage_registry import registry

    lines = ["# qprep config keys", ""] + reference(SCHEMA)
    for name, stage in sorted(registry().items()):
        lines += ["", f"# stage `{name}`: {stage.summary}"] + reference(stage.options, f"pipeline[].{name}")
    print("\n".join(lines))
    return EXIT_OK


def cmd_batch(args) -> int:
    from qprep.pipeline.batch import exit_code, run_batch

    summary = run_batch(args.config, args.folder, args.out, jobs=args.jobs, recursive=args.recursive,
                        resume=args.resume, timeout=args.timeout, sets=args.sets, quiet=args.quiet,
                        executor=args.executor, address=args.address, guard=args.guard)
    counts = summary["counts"]
    print(f"qprep batch: {counts['ok']} ok, {counts['gate missed']} gate missed, {counts['refused']} refused, "
          f"{counts['failed']} failed — {Path(args.out) / 'summary.md'}")
    return exit_code(summary)


def _evaluated_state(passed: bool, evaluation: dict, run_dir: str) -> str:
    """'met', 'missed', or as the run's report says it, 'met, but mostly float': its result's integer share under
    evaluation.min_integer_share (verdict.mostly_float)."""
    from qprep import jsonfile
    from qprep.disk.reading import read_json
    from qprep.report.verdict import mostly_float

    if not passed:
        return "missed"
    try:  # reevaluate read it already
        result = jsonfile.numbers(read_json(Path(run_dir) / "report.json")).get("result") or {}
    except (OSError, ValueError):
        return "met"
    return "met, but mostly float" if mostly_float({"evaluation": evaluation, "result": result}) is not None else "met"


def cmd_evaluate(args) -> int:
    from qprep import jsonfile
    from qprep.config import parse_set
    from qprep.pipeline.reevaluate import reevaluate
    from qprep.pipeline.run_dir import recorded_inputs

    args.guard.add_inputs(recorded_inputs(Path(args.run_dir)))  # the run's model, config and data
    if args.json_out:
        args.guard.output_file(args.json_out, "--json")  # before minutes of evaluation, not after
    result = reevaluate(args.run_dir, args.samples, args.labels, dict(parse_set(s) for s in args.sets), args.quiet,
                        args.guard)
    from qprep.report.verdict import decided_by

    figure = decided_by(result, split=str(args.samples))  # the verdict's own figure, as compare and batch show it
    if figure:
        result["decided_by"] = figure
    from qprep.evaluate import calibration_note

    calibrated = calibration_note(result)
    if calibrated:
        result["notes"] = [calibrated, *result.get("notes", [])]
    if args.json_out:
        args.guard.write_text(args.json_out, jsonfile.dumps(result) + "\n", "--json")
    count = result["samples"]["count"]
    for name, metrics in result["outputs"].items():
        print(f"{name}: cosine_mean {_fmt(metrics.get('cosine_mean'))}"
              + "".join(f", {key} {_fmt(metrics[key])}" for key in ("top1_agreement", "step_agreement",
                                                                     "element_agreement") if key in metrics)
              + f" ({count} samples)")
        if "top1_accuracy" in metrics:  # --labels: the task's own figure, on the terminal as in --json
            print(f"{name}: top-1 accuracy against labels: FP32 {_fmt(metrics.get('reference_top1_accuracy'))}, "
                  f"result {_fmt(metrics['top1_accuracy'])} ({metrics.get('labelled_samples', '?')} labelled)")
    metric = result.get("metric")
    if metric:  # the user's evaluation.metric, whether or not the gate reads it
        print(f"evaluation.metric {metric.get('function')}: FP32 {_fmt(metric.get('reference_metric'))}, result "
              f"{_fmt(metric.get('metric'))}, drop {_fmt(metric.get('metric_drop'))} ({metric.get('samples')} samples)")
    if figure:
        print(f"qprep: {_evaluated_state(figure['passed'], result, args.run_dir)}: {figure['text'].replace('`', '')}")
    if result.get("repeats"):
        print(f"qprep: note: {result['repeats']}")
    if calibrated:
        print(f"qprep: note: {calibrated}")
    gate = result.get("gate")
    if gate and not gate["passed"]:
        from qprep.report.verdict import missed_text

        print(f"qprep: gate missed on {args.samples}: {missed_text(result)}", file=sys.stderr)
        return EXIT_GATE_MISSED
    return EXIT_OK


def cmd_compare(args) -> int:
    from qprep.report.compare import compare, render_html, render_markdown, render_text

    thresholds = {}
    for item in args.fail_on_regression:
        metric, _, value = item.partition("=")
        try:
            thresholds[metric.strip()] = float(value)
        except ValueError:
            thresholds[metric.strip()] = math.nan
        if not 0 <= thresholds[metric.strip()] < math.inf:  # a NaN threshold judges nothing, a negative one all
            raise QprepError(f"--fail-on-regression {item}: expected METRIC=THRESHOLD with a finite threshold "
                             "of 0 or more, e.g. cosine_mean=0.005")
    # A report.json or summary.json stands for its run or batch folder: nothing is written into either.
    args.guard.add_inputs({f"the compared run {run}": Path(run).parent for run in args.runs if Path(run).is_file()})
    for option, path in (("--markdown", args.markdown), ("--html", args.html)):
        if path:
            args.guard.output_file(path, option)  # before the table is printed
    result = compare(args.runs, thresholds)
    print(render_text(result), end="")
    for option, path, render in (("--markdown", args.markdown, render_markdown), ("--html", args.html, render_html)):
        if path:
            args.guard.write_text(path, render(result), option)
    return EXIT_GATE_MISSED if result["regressions"] else EXIT_OK


MAX_TERMINAL_WARNINGS = 5  # the rest are in report.md

COMMANDS = {"run": cmd_run, "validate": cmd_validate, "inspect": cmd_inspect, "init": cmd_init,
            "config": cmd_config, "batch": cmd_batch, "compare": cmd_compare, "evaluate": cmd_evaluate,
            "setup": cmd_setup, "completion": cmd_completion}
