"""What the quantize stage decided, one line per decision with the figure that decided it, and the files a run
leaves for deployment with how to run them: both were only in report.json and the log.

Decisions: the range method (and the one the fallback measured and kept), GPTQ weight rounding (calibration
SQNR before → after, kept or not), bias correction, the accuracy-driven fallback (target, float nodes,
seconds, steps the time budget skipped), the nodes kept float (asked for, NaN/Inf ranges, ORT failures) and
what was done to fit the backend (opset conversion, float16 clipping of masks, outlier positions computed apart).
Files: what each deployable file is for, and what to feed each input, written from the input contract.
"""

from __future__ import annotations

from qprep.quantize.rknn.contract import GRAY, channel_order, image_channels
from qprep.report.fallback import fallback_tables
from qprep.report.float_nodes import REASONS, FloatNodes, float_nodes


def decision_lines(stage: dict, report: dict | None = None) -> list[str]:
    """The decisions of one quantize stage record (empty for other stages); `report` (the whole report.json)
    gives the count of the result's float nodes (float_nodes.py), else the stage's own."""
    if stage.get("name") != "quantize" or stage.get("status") != "ok":
        return []
    found = float_nodes(report) if report is not None else None
    return [line for line in (_qat(stage), _float32_copy(stage), _activations(stage), _weights(stage), _ranges(stage), _rounding(stage), _bias(stage), _fallback(stage, found),
                              _spread(stage), _float_nodes(stage, found), _fast_kernels(stage),
                              *_fitting(stage), *_rules_disabled(stage)) if line]


def _qat(stage: dict) -> str:
    """A QAT model built by rknn-toolkit2 from its own Q/DQ scales."""
    qat = stage.get("qat")
    return f"QAT model: int8 from {qat['scales']}; {qat['layers']}" if qat else ""


def _float32_copy(stage: dict) -> str:
    """A float16 or float64 input model: quantized from its float32 copy, or left as it was (why)."""
    copy = stage.get("float32_copy")
    if not copy:
        return ""
    source = copy["from"]
    if not copy["applied"]:
        return f"{source} model **left {source}** (not quantized): {copy['why']}"
    agreement = f"; outputs agree with the {source} model to cosine {copy['cosine_min']:.5f}" \
        if "cosine_min" in copy else ""
    casts = copy["interface_casts"]
    interface = f"; its {casts} {source} inputs/outputs stay {source} (a Cast each)" if casts else ""
    rounding = "exact in float32" if source == "float16" else "rounded to float32"
    return f"{source} model: quantized from its float32 copy ({copy['weights']} {source} weights, {rounding}" \
           f"{agreement}){interface}"


def _rules_disabled(stage: dict) -> list[str]:
    """RKNN: the toolkit's graph rules switched off because they failed on this model."""
    return [f"rknn-toolkit2 graph rule `{item['rule']}` **disabled**: it failed on this model ({item['error']}); "
            "built again without it (`disable_rules`), the model is the same, perhaps slower on the NPU"
            for item in stage.get("rules_disabled") or []]


def _activations(stage: dict) -> str:
    """ORT: static or dynamic activation ranges, and why when `auto` chose."""
    activations = stage.get("activations") or {}
    if "chosen" in activations:
        return f"activations: **{activations['chosen']}** ({activations['why']})"
    return f"activations: {activations['configured']} (configured)" if activations else ""


def _weights(stage: dict) -> str:
    """ORT: 8-bit int8, 7-bit int8 or symmetric uint8 weights, and why (this CPU's u8s8 kernels, when auto)."""
    weights = stage.get("weights") or {}
    if not weights:
        return ""
    if weights.get("type") == "uint8":
        bits = "**uint8** (symmetric, 8-bit)"
    else:
        bits = "**7-bit** (reduce_range)" if weights.get("reduce_range") else "8-bit"
    rescaled = weights.get("bias_channels_rescaled")
    coarser = (f"; {rescaled} channel(s) with a coarser weight scale, so that their bias fits int32 (their weights "
               "are ~0: BatchNorm switched them off)" if rescaled else "")
    return f"weights: {bits} — {weights.get('why', '?')}{coarser}"


def _ranges(stage: dict) -> str:
    config = stage.get("config") or {}
    if stage.get("backend") == "rknn":
        text = (f"ranges: RKNN `{config.get('quantized_algorithm', '?')}` algorithm, "
                f"{config.get('quantized_dtype', '?')}, per-{config.get('quantized_method', '?')} weights")
    elif stage.get("calibrate_method"):
        text = f"ranges: `{stage['calibrate_method']}` calibration"
    else:
        return ""
    text += f" on {stage['calibration_samples']} calibration samples" if stage.get("calibration_samples") else ""
    record = stage.get("fallback") or {}
    measured = [record.get(key) or {} for key in ("ranges", "ranges_with_spread", "ranges_after_search")]
    measured = [m for m in measured if len(m.get("scores", {})) > 1]
    if measured:  # the fallback's line gives the scores
        text += f" (chosen by the fallback; configured: {measured[0].get('configured', '?')})"
    return text


def _rounding(stage: dict) -> str:
    rounding = stage.get("weight_rounding") or {}
    if not rounding:
        return ""
    if rounding.get("method") == "mmse":  # the mmse algorithm's own search is "mmse search"
        measured = (stage.get("fallback") or {}).get("weight_rounding") or {}
        chosen = " (chosen by the fallback)" if measured.get("chosen") == "mmse" else ""
        return (f"weight ranges: those of an RKNN `mmse` build on {rounding['calibration_samples']} calibration "
                f"samples ({rounding.get('seconds', 0):.0f} s), nearest rounding{chosen}")
    if rounding.get("method") != "gptq":
        return f"weight rounding: {rounding.get('method', '?')} (GPTQ off)"
    layers = f" on {rounding['layers']} layers" if "layers" in rounding else ""
    nearest = []
    if rounding.get("underdetermined"):
        nearest.append(f"{rounding['underdetermined']} more kept nearest: too few calibration rows for their "
                       "inputs, GPTQ would fit the samples")
    if rounding.get("too_wide"):
        nearest.append(f"{rounding['too_wide']} more kept nearest: over {rounding.get('max_inputs', '?')} inputs "
                       "per output, beyond GPTQ's time and memory here")
    if nearest:
        layers += f" ({'; '.join(nearest)})"
    measured = rounding.get("calibration_sqnr_db")
    if isinstance(measured, dict) and "nearest" in measured:
        verdict = "**kept**" if rounding.get("kept") else f"**not kept** ({rounding.get('reason', 'no gain')})"
        return (f"GPTQ weight rounding{layers}: calibration output SQNR {_db(measured['nearest'])} (nearest) → "
                f"{_db(measured['gptq'])} (GPTQ) — {verdict}")
    if rounding.get("kept") is False:
        return f"GPTQ weight rounding: **not applied** ({rounding.get('reason', '?')})"
    seconds = f", {rounding['seconds']:.1f} s" if "seconds" in rounding else ""
    return f"GPTQ weight rounding{layers} (on the toolkit's weight grid{seconds}): applied"


def _bias(stage: dict) -> str:
    bias = stage.get("bias_correction") or {}
    if not bias:
        return ""
    measured = bias.get("calibration_sqnr_db")
    verdict = "**kept**" if bias.get("kept") else f"**left out** ({bias.get('reason', 'no gain')})"
    if isinstance(measured, dict):
        return (f"bias correction on {bias.get('layers', '?')} layers: calibration output SQNR "
                f"{_db(measured['before'])} → {_db(measured['after'])} — {verdict}")
    return f"bias correction: {verdict}"


def _fallback(stage: dict, found: FloatNodes | None = None) -> str:
    view = fallback_tables(stage, None if found is None else found.count)
    if view is None:
        return ""
    skipped = ((stage["fallback"].get("budget") or {}).get("skipped")) or []
    budget = f" Skipped for lack of time (time_budget_s): {'; '.join(skipped)}." if skipped else ""
    return f"accuracy-driven fallback: {view[0]}{budget}" + (" (trials: the Stages section)" if view[1] else "")


def _spread(stage: dict) -> str:
    """Activations kept out of int8 (ORT: float or 16-bit; RKNN: float16) because their channels spread too far
    for one int8 scale."""
    record = (stage.get("fallback") or {}).get("spread_tensors") or {}
    tensors = record.get("tensors") or []
    if not tensors:
        return ""
    worst = ", ".join(f"`{t['tensor']}` {t['levels']:g}" for t in tensors[:3])
    kept = ("quantized to 16 bits (ONNX Runtime's CPU runs their neighbours in float)" if record.get("as") == "int16"
            else f"kept {record.get('as', 'float')} with their producers and consumers "
                 f"({record.get('nodes', '?')} {'layers' if record.get('as') == 'float16' else 'nodes'})")
    return (f"{len(tensors)} tensor(s) whose channels spread too far for one int8 scale {kept}; int8 levels of the "
            f"median channel: {worst}{', …' if len(tensors) > 3 else ''}")


def _float_nodes(stage: dict, found: FloatNodes | None = None) -> str:
    """How many nodes of the result run float and why (the count of float_nodes.py, which the "Kept float"
    table names); NaN/Inf or huge ranges no int8/float16 grid holds, nodes ORT's quantizer fails on."""
    if found is not None:
        why = [f"{len(nodes)} {REASONS[reason][0]}" for reason, nodes in found.groups.items()]
        why += [f"{count} {REASONS[reason][0]}" for reason, count in found.unnamed.items()]
        parts = [f"{found.count} node(s) of the result run float ({'; '.join(why)}; named under Kept float)"] \
            if found.count else []
    else:
        count = len(stage["excluded_nodes"]) if "excluded_nodes" in stage else stage.get("float_set_size")
        parts = [f"{count} node(s) kept float"] if count else []
    nodes = ((stage.get("nonfinite") or {}).get("nodes")) or {}
    if nodes:
        first = next(iter(nodes.items()))
        parts.append(f"{len(nodes)} of them for NaN/Inf or out-of-range values (e.g. `{first[0]}`: {first[1]})")
    failed = stage.get("unquantizable") or []
    if failed:
        parts.append(f"{len(failed)} that ONNX Runtime's quantizer fails on (e.g. `{failed[0]['node']}`: "
                     f"{failed[0]['reason']})")
    unmatched = stage.get("float_set_unmatched") or []
    if unmatched:
        parts.append(f"{len(unmatched)} asked-for node(s) no longer in the model (run keep_float after optimize)")
    return "float nodes: " + "; ".join(parts) if parts else ""


def _fast_kernels(stage: dict) -> str:
    """ORT: what was done for its fast int8 convolution kernels (quantize/ort/channel_padding.py, input_convs.py)."""
    parts = []
    narrow = stage.get("float_for_speed") or []
    if narrow:
        parts.append(f"{len(narrow)} Conv(s) reading the model's input kept float (too few channels for ONNX "
                     f"Runtime's fast int8 kernels: `{narrow[0]}`{', …' if len(narrow) > 1 else ''})")
    padding = stage.get("channel_padding") or {}
    if "why" in padding and not padding.get("spaces"):
        parts.append(f"channel padding not applied ({padding['why']})")
    if padding.get("spaces"):
        spaces = padding["spaces"]
        examples = ", ".join(f"{s['channels']} → {s['padded_to']}" for s in spaces[:3])
        timing = f": {padding['ms_before']:.3f} → {padding['ms_after']:.3f} ms per run" if "ms_before" in padding else ""
        outcome = "kept" if padding["kept"] else f"not kept ({padding.get('why', '')})"
        parts.append(f"{len(spaces)} channel counts padded with zero channels to multiples of 16 for them "
                     f"({examples}{', …' if len(spaces) > 3 else ''}; the same outputs){timing}, {outcome}")
    return "fast kernels: " + "; ".join(parts) if parts else ""


def _fitting(stage: dict) -> list[str]:
    lines = []
    converted = stage.get("opset_converted")
    if converted:
        lines.append(f"opset converted {converted['from']} → {converted['to']} for the backend (verified on "
                     f"{converted.get('verified_on', '?')} samples)")
    nonfinite = stage.get("nonfinite") or {}
    clip = nonfinite.get("float16_clip") or {}
    if clip:
        mask = clip.get("mask_bound") if clip.get("clipped") else None
        if mask:
            others = len(clip.get("constants", [])) - len(mask["constants"])
            own = mask.get("own_fills") or {}
            lines.append(f"attention-mask fill clipped to ±{mask['bound']:.3g} for int8 attention (a masked score rose "
                         f"{mask['excess']:.3g} above its row's largest on calibration data; twice that + "
                         f"{mask['margin']:g})" + (f", {len(own)} attention(s) masked with their own lower fill "
                                                  f"({min(own.values()):.3g}–{max(own.values()):.3g})" if own else "")
                         + (f"; {others} other constant(s) beyond float16 to ±{clip.get('bound', '?'):g}"
                            if others else ""))
        else:
            done = "clipped" if clip.get("clipped") else f"left as they are ({clip.get('reason', '?')})"
            lines.append(f"{len(clip.get('constants', []))} constant(s) beyond float16 (masks) {done} to "
                         f"±{clip.get('bound', '?'):g}")
        if clip.get("left"):
            lines.append(f"{len(clip['left'])} constant(s) beyond float16 left as they are, since clipped they change "
                         f"the outputs: " + "; ".join(f"{name} ({why})" for name, why in clip["left"].items()))
    smoothed = (stage.get("smoothed_layernorms") or {}).get("layernorms") or []
    if smoothed:
        worst = max(smoothed, key=lambda entry: entry["spread_before"])
        lines.append(f"{len(smoothed)} LayerNorm output(s) smoothed into the following MatMuls' weights, so one int8 "
                     f"scale fits their channels (largest/median channel {worst['spread_before']:g} → "
                     f"{worst['spread_after']:g} at {worst['layernorm']}; exact in float32)")
    split = stage.get("outlier_positions") or {}
    if split.get("chains"):
        runs = sorted({(a, b) for chain in split["chains"] for a, b in chain["outliers"]})
        outliers = [f"{a}" if b == a + 1 else f"{a}-{b - 1}" for a, b in runs]
        lines.append(f"{len(split['chains'])} LayerNorm chain(s) computed apart for sequence position(s) "
                     f"{', '.join(outliers)}, whose activations stand far above the rest, so int8 ranges fit both "
                     f"(exact in float32, verified on {split.get('verified_on', '?')} samples)")
    rescaled = (stage.get("residual_channels") or {}).get("layernorms") or []
    if rescaled:
        worst = max(rescaled, key=lambda entry: entry["spread_before"])
        lines.append(f"{len(rescaled)} residual sum(s) with huge channels scaled down before int8, their LayerNorm "
                     f"computed from the scaled sum (largest/median channel {worst['spread_before']:g} at "
                     f"{worst['layernorm']}; exact in float32)")
    float16 = stage.get("float16_layers") or {}
    if float16.get("ir_tensors"):  # what a "≤ N non-int8 layers" budget counts: fused nodes are one layer
        unmapped = float16.get("unmapped") or []
        lines.append(f"{len(float16['ir_tensors'])} layer(s) of the RKNN model float16, the rest int8 (from the "
                     f"{len(float16.get('mapped') or {})} float node(s) under Kept float"
                     + (f"; {len(unmapped)} more float-set node(s) have no layer of their own in the toolkit's graph: "
                        + ", ".join(f"`{n}`" for n in unmapped[:3]) + (", …" if len(unmapped) > 3 else "")
                        if unmapped else "") + ")")
    int8_again = [n for n, why in (nonfinite.get("int8_not_float16") or {}).items() if why.startswith("int8:")]
    if int8_again:
        lines.append(f"{len(int8_again)} node(s) kept float for their values are int8 again once clipped")
    return lines


def _db(value) -> str:
    return "not measured" if value is None else f"{value:.2f} dB"


def files_lines(report: dict) -> list[str]:
    """The deployable files of the run directory, what each is for, and the one command that runs them. What to
    feed is written from the input contract (RKNN: input_contract.json, in report.json as
    result.input_contract) or the deployed model's inputs, with the calibration's image preprocessing: an
    audio model's user was told to feed "raw uint8 pixels (NHWC)", a channels-last classifier's that the NPU
    applies a mean/std it was never given."""
    result = report.get("result") or {}
    if not result:
        return []
    artifacts = result.get("artifacts") or []
    deployable = result.get("deployable")
    image = (report.get("calibration") or {}).get("preprocess")
    lines = []
    if "model.rknn" in artifacts or (deployable or {}).get("path") == "model.rknn":
        contract = result.get("input_contract")
        lines += ["`model.rknn`: the NPU model to deploy (`model.onnx` beside it is the prepared float model it was "
                  "built from)",
                  _contract_line(contract, image) if "input_contract.json" in artifacts else "",
                  _board_line(contract) if "run_on_board.py" in artifacts else ""]
    else:
        path = result.get("path", "model.onnx")
        inputs = result.get("inputs")
        feed = ("; feed " + _inputs_text(inputs, image, npu=False) if inputs else
                f"; feed inputs preprocessed as the calibration data was (`qprep inspect {path}` lists them)")
        lines.append(f"`{path}`: the {result.get('kind', '?')} model to deploy with ONNX Runtime "
                     f"(`onnxruntime.InferenceSession('{path}')`){feed}")
    lines += _noise_lines(result)
    lines.append("`report.json` (every figure of this report), `manifest.json` (input hashes, resolved config, "
                 "versions), `qprep.log`")
    return [line for line in lines if line]


def _noise_lines(result: dict) -> list[str]:
    """A model with random ops was measured on noise drawn once per sample and fed alike to the float model and the
    result (qprep/model/noise.py): say so, and whether the deployable draws it itself or takes it as an input."""
    noise = result.get("noise") or {}
    lines = []
    for source in noise.get("drawn", []):
        spread = (f"N({source['mean']:g}, {source['scale']:g})" if "mean" in source else
                  f"U({source['low']:g}, {source['high']:g})")
        drawn = f"`{source['node']}` ({source['op']}, {spread})"
        if source["input"] in noise.get("inputs", []):
            lines.append(f"random op {drawn}: the deployed model takes its values as input `{source['input']}` — "
                         f"feed {source['dtype']} values drawn from {spread} on each call; the figures above fed the "
                         "float model and the result the same values, drawn once per sample")
        else:
            lines.append(f"random op {drawn}: the deployed model draws its values itself; the figures above fed the "
                         "float model and the result the same values, drawn once per sample")
    return lines


MAX_INPUTS_LISTED = 6  # a decoder with KV-cache inputs: the rest are in the contract


def _described(contract: dict | None) -> bool:
    """Whether the contract states each input's ONNX input and feed (one written before them is described in
    general words, never with fields read as what they no longer mean)."""
    inputs = (contract or {}).get("inputs")
    return bool(inputs) and all("onnx_input" in entry for entry in inputs)


def _contract_line(contract: dict | None, image: dict | None) -> str:
    if not _described(contract):  # a report written before the contract was in report.json, or had `feed`
        return ("`input_contract.json`: what to feed each input — names, shapes, dtypes, and for an image input the "
                "NPU normalizes, its channel order and mean/std")
    return "`input_contract.json`: what to feed — " + _inputs_text(contract["inputs"], image, npu=True)


def _inputs_text(inputs: list[dict], image: dict | None, npu: bool) -> str:
    shown = [feed_text(entry, image, npu) for entry in inputs[:MAX_INPUTS_LISTED]]
    more = len(inputs) - len(shown)
    return "; ".join(shown) + (f"; and {more} more input(s)" + (" (see the contract)" if npu else "")
                               if more > 0 else "")


def feed_text(entry: dict, image: dict | None, npu: bool) -> str:
    """What one input takes: raw pixels where the NPU applies mean/std itself (the contract's `feed` gives them,
    the fields run_on_board.py reads); an image input without that, the values the calibration read it as
    (layout, channel order, mean/std, in the model's dtype); any other input, its dtype and shape as the ONNX model
    takes it. Only image inputs speak of pixels. `entry`: a contract input, or an ONNX Runtime result's input
    (name, dtype, shape: what a contract's `onnx_input` holds)."""
    onnx_input = entry.get("onnx_input") or entry
    name, dtype, shape = entry.get("name", "?"), onnx_input.get("dtype", "?"), _shape(onnx_input.get("shape"))
    if entry.get("ignored"):  # no node reads it: model.rknn has no such input (rknn/static_graph/hygiene.py)
        return f"`{name}`: not fed (no node of the model reads it; the board runner skips it)"
    feed = entry.get("feed") if isinstance(entry.get("feed"), dict) else {}
    if npu_normalized(entry):
        order = channel_order(feed.get("channel_order", "rgb"), image_channels(feed.get("shape"), "nhwc"))
        return (f"`{name}`: raw {feed.get('dtype', '?')} pixels, {feed.get('layout', '?')} "
                f"{_shape(feed.get('shape'))}, {_order_text(order)}, resized as the calibration images were "
                f"({feed.get('resize', 'stretch')}); the NPU applies "
                f"(x − mean) / std itself (mean {_numbers(feed.get('mean'))}, std {_numbers(feed.get('std'))})")
    if image and image.get("input") == name:
        mean, std = image.get("mean"), image.get("std")
        formula = {(True, True): "(x − mean) / std", (True, False): "x − mean", (False, True): "x / std"}
        given = [f"{key} {_numbers(v)}" for key, v in (("mean", mean), ("std", std)) if v is not None]
        values = (f"{formula[mean is not None, std is not None]} of the 0–255 pixel values x with {', '.join(given)}"
                  if given else "the 0–255 pixel values")
        order = channel_order(image.get("channel_order", "rgb"),
                              image_channels(onnx_input.get("shape"), image.get("layout", "?")))
        return (f"`{name}`: {dtype} {shape}, {str(image.get('layout', '?')).upper()}: the image as calibration read "
                f"it — {_order_text(order)}, resized "
                f"({image.get('resize', 'stretch')}), {values}" + ("; the NPU applies no mean/std" if npu else ""))
    return f"`{name}`: {dtype} {shape}, the values the ONNX model takes (as in the calibration samples)"


def _order_text(order: str) -> str:
    """A 1-channel image is read as grayscale: it has no RGB or BGR order to name (contract.channel_order)."""
    return "grayscale (1 channel)" if order == GRAY else f"{str(order).upper()} channel order"


def npu_normalized(entry: dict) -> bool:
    """A contract input the NPU applies mean/std to: the board feeds it raw pixels (an image file to the runner)."""
    feed = entry.get("feed")
    return isinstance(feed, dict) and feed.get("mean_std_applied_by") == "npu" and not entry.get("ignored")


def _board_line(contract: dict | None) -> str:
    """The runner's command for what it accepts: an image file for a single input the NPU normalizes, else an
    .npz with one array per input name (run_on_board.py)."""
    head = ("`run_on_board.py`: an example runner; on the board: `pip install rknn-toolkit-lite2`, copy the three "
            "files, then ")
    if contract and not _described(contract):
        return head + ("`python3 run_on_board.py image.png` for a single input the NPU normalizes, else "
                       "`python3 run_on_board.py sample.npz` (one array per input name)")
    inputs = [entry for entry in (contract or {}).get("inputs") or [] if not entry.get("ignored")]
    if len(inputs) == 1 and npu_normalized(inputs[0]):
        return head + "`python3 run_on_board.py image.png`"
    names = ", ".join(f"`{entry.get('name', '?')}`" for entry in inputs[:MAX_INPUTS_LISTED])
    return head + "`python3 run_on_board.py sample.npz`" + (
        f" (one array per input: {names}{', …' if len(inputs) > MAX_INPUTS_LISTED else ''}, as above)" if names else
        " (one array per input name, each as input_contract.json's `feed` says)")


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]" if isinstance(shape, list) else "(shape not known)"


def _numbers(values) -> str:
    return "[" + ", ".join(f"{float(v):g}" for v in values) + "]" if isinstance(values, list) else str(values)
