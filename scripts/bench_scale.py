"""How qprep's time and memory grow with model size, beside ONNX Runtime's quantize_static on the same model.

BERT encoders exported from `transformers` (`BertModel`, random weights, default config but for the size,
intermediate 4 × hidden, `torch.onnx.export(dynamo=False, opset_version=17)`, sequence 128; over 2 GB torch
writes external data, one file per tensor), 16 calibration and 8 evaluation samples (.npz: random token ids,
padded lengths, so the additive attention mask is in play). Each tool runs in its own process under
`/usr/bin/time -v` (wall time and peak RSS of the whole process):

    qprep:  optimize → quantize(ort) with `evaluation:` (the default pipeline, as a user would run it)
    ORT:    quantize_static alone (QDQ, per-channel, U8S8, MinMax, same calibration samples)

    .venv/bin/python scripts/bench_scale.py [--sizes 6x384 12x768 24x1024 24x1600] [--backend ort|fp16]
                                            [--work DIR] [--markdown F]

Exports and samples are kept in --work (default /tmp/qprep-scale) and reused. Needs torch and transformers
(`pip install torch==2.13.0 transformers`); 24x1600 (2.9 GB) needs ~20 GB of RAM.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
SEQUENCE = 128
VOCAB = 30522

ORT_ALONE = """
import sys
from pathlib import Path
import numpy as np
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

model, calib, out, large = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "1"

class Reader(CalibrationDataReader):
    def __init__(self):
        self.files = iter(sorted(calib.glob("*.npz")))
    def get_next(self):
        path = next(self.files, None)
        return None if path is None else dict(np.load(path))

quantize_static(model, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, use_external_data_format=large)
"""


def export(layers: int, hidden: int, folder: Path) -> Path:
    """The BERT encoder of this size as ONNX (once)."""
    path = folder / "model.onnx"
    if path.exists():
        return path
    import torch
    from transformers import BertConfig, BertModel

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                        intermediate_size=4 * hidden)

    class Encoder(torch.nn.Module):  # keyword arguments: BertModel's positional order changed across versions
        def __init__(self):
            super().__init__()
            self.bert = BertModel(config).eval()

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            return out.last_hidden_state, out.pooler_output

    ids = torch.zeros(1, SEQUENCE, dtype=torch.int64)
    with torch.no_grad():
        torch.onnx.export(Encoder().eval(), (ids, torch.ones_like(ids), torch.zeros_like(ids)), str(path), dynamo=False,
                          opset_version=17, input_names=["input_ids", "attention_mask", "token_type_ids"],
                          output_names=["last_hidden_state", "pooler_output"])
    return path


def samples(folder: Path, name: str, count: int, seed: int) -> Path:
    """`count` .npz samples: random ids after [CLS], then padding ([PAD] = 0, mask 0) from a random length."""
    out = folder / name
    if out.is_dir() and len(list(out.glob("*.npz"))) == count:
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        length = int(rng.integers(SEQUENCE // 4, SEQUENCE + 1))
        ids = np.zeros((1, SEQUENCE), np.int64)
        ids[0, :length] = rng.integers(1000, VOCAB, length)
        ids[0, 0], ids[0, length - 1] = 101, 102
        mask = (ids != 0).astype(np.int64)
        np.savez(out / f"{i:03d}.npz", input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    return out


def timed(command: list[str], cwd: Path, log: Path) -> dict:
    """Wall seconds and peak RSS (GB) of `command` under /usr/bin/time -v; its output goes to `log`."""
    with open(log, "w") as f:
        done = subprocess.run(["/usr/bin/time", "-v", *command], cwd=cwd, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.group(1).split(":")))) if wall else None
    return {"seconds": seconds, "gb": int(rss.group(1)) / 2**20 if rss else None, "exit": done.returncode}


def size_gb(model: Path) -> float:
    return sum(f.stat().st_size for f in model.parent.iterdir() if f.is_file() and f.suffix != ".yaml"
               and not f.name.startswith("qprep")) / 1e9


def measure(label: str, work: Path, backend: str = "ort") -> dict:
    layers, hidden = (int(v) for v in label.split("x"))
    folder = work / label
    model = export(layers, hidden, folder / "export")
    calib, evaluation = samples(folder, "calib", 16, 0), samples(folder, "eval", 8, 1)
    suffix = "" if backend == "ort" else f"_{backend}"
    config = folder / f"qprep{suffix}.yaml"
    config.write_text(json.dumps({  # JSON is YAML
        "model": str(model), "calibration": {"source": str(calib)}, "evaluation": {"source": str(evaluation)},
        "output_dir": str(folder / f"qprep_run{suffix}"),
        "pipeline": [{"optimize": {}}, {"quantize": {"backend": backend}}]}, indent=1))
    row = {"model": label if backend == "ort" else f"{label} ({backend})", "size_gb": size_gb(model)}
    print(f"bench_scale: {label} ({row['size_gb']:.2f} GB): qprep", file=sys.stderr, flush=True)
    row["qprep"] = timed([PYTHON, "-m", "qprep", "run", str(config), "--force", "--quiet"], folder,
                         folder / f"qprep{suffix}.log")
    report = folder / f"qprep_run{suffix}" / "report.json"
    if report.exists():
        data = json.loads(report.read_text())
        row["cosine"] = min((m.get("cosine_mean") for m in data.get("evaluation", {}).get("outputs", {}).values()
                             if m.get("cosine_mean") is not None), default=None)
        row["status"] = data.get("status")
    print(f"bench_scale: {label}: ORT quantize_static", file=sys.stderr, flush=True)
    for old in folder.glob("ort.int8.onnx*"):  # its external-data writer refuses to overwrite a previous run's
        old.unlink()
    row["ort"] = timed([PYTHON, "-c", ORT_ALONE, str(model), str(calib), str(folder / "ort.int8.onnx"),
                        "1" if row["size_gb"] > 2 else "0"], folder, folder / "ort.log")
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | size | qprep | ORT quantize_static | ratio time / memory | qprep per GB | ORT per GB | "
             "qprep cosine (worst output) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        q, o, gb = r["qprep"], r["ort"], r["size_gb"]

        def run(m):
            return f"{m['seconds']:.0f} s, {m['gb']:.1f} GB" + ("" if m["exit"] == 0 else f" (exit {m['exit']})")

        ratio = (f"{q['seconds'] / o['seconds']:.1f}× / {q['gb'] / o['gb']:.1f}×"
                 if q["exit"] == 0 and o["exit"] == 0 else "–")
        cosine = "–" if r.get("cosine") is None else f"{r['cosine']:.4f}"
        lines.append(f"| {r['model']} | {gb:.2f} GB | {run(q)} | {run(o)} | {ratio} | "
                     f"{q['seconds'] / gb:.0f} s, {q['gb'] / gb:.1f} GB | {o['seconds'] / gb:.0f} s, {o['gb'] / gb:.1f} GB"
                     f" | {cosine} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="*", default=["6x384", "12x768", "24x1024"],
                        help="layers x hidden (24x1600 is the 2.9 GB external-data model)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/qprep-scale"))
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--backend", default="ort", choices=("ort", "fp16"),
                        help="qprep's quantize backend (ORT alone is always quantize_static INT8)")
    args = parser.parse_args()
    rows = []
    for label in args.sizes:
        rows.append(measure(label, args.work, args.backend))
        print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
