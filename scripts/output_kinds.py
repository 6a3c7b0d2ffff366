"""Print how the evaluation would judge each output of a model: name, kind, why (qprep/measure/kinds.py).

    python3 scripts/output_kinds.py MODEL [SAMPLES] [--inputs NAME=1,3,48,320 ...] [--markdown]

SAMPLES: a folder of evaluation samples (npz/npy/images, read as `evaluation.source` is, with the defaults);
MODEL.qprep.yaml beside the model (a zoo sidecar) or --inputs fixes its input dims (`inputs:`). Without SAMPLES, seeded
random inputs (kinds that read values, such as `probability`, may then differ from a run's).
The kinds depend on the reference's values as well as on the graph, so give the samples a run uses.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qprep.config import evaluation_section  # noqa: E402
from qprep.data.samples import load_samples, random_samples  # noqa: E402
from qprep.model.info import graph_inputs  # noqa: E402
import onnx  # noqa: E402
import yaml  # noqa: E402
from qprep.model.prepare import fix_input_shapes  # noqa: E402
from qprep.model.runtime import run_model  # noqa: E402
from qprep.measure.kinds import output_kinds  # noqa: E402
from qprep.schema import validate  # noqa: E402

MAX_SAMPLES = 16


def kinds_of(model_path: str, samples: str | None = None, shapes: dict | None = None) -> dict[str, tuple[str, str]]:
    model = onnx.load(model_path)
    sidecar = Path(model_path).with_suffix(".qprep.yaml")
    if sidecar.exists():
        shapes = {**((yaml.safe_load(sidecar.read_text()) or {}).get("inputs") or {}), **(shapes or {})}
    if shapes:
        fix_input_shapes(model, shapes)
    inputs = graph_inputs(model)
    if samples:
        section = validate({"source": samples, "max_samples": MAX_SAMPLES}, evaluation_section(), "evaluation",
                           Path.cwd())
        sample_set = load_samples(section, inputs, "evaluation")
    else:
        sample_set = random_samples(inputs, 4)
    return output_kinds(model, run_model(model, sample_set.samples), {})


def main(argv: list[str]) -> int:
    markdown = "--markdown" in argv
    args, shapes, rest = [], {}, iter(a for a in argv if a != "--markdown")
    for arg in rest:
        if arg == "--inputs":
            name, _, dims = next(rest, "").partition("=")
            shapes[name] = [int(d) for d in dims.split(",") if d]
        else:
            args.append(arg)
    if not args or len(args) > 2:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    kinds = kinds_of(*args, shapes=shapes)
    for name, (kind, why) in kinds.items():
        if markdown:
            print(f"| {Path(args[0]).stem} | `{name}` | `{kind}` | {why} |")
        else:
            print(f"{name}\t{kind}\t{why}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
