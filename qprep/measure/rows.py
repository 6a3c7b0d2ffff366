"""Outputs whose rows NonMaxSuppression or TopK chose: compared as sets of rows, not element by element.

Why: when a score moves, NMS keeps another box or lists the same boxes in another order, and TopK reorders
its picks; an elementwise cosine then compares different objects row by row (and cannot compare at all when
the counts differ). So:

- `boxes` (detections: rows of four box coordinates, optionally followed by score/class columns): reference and
  result rows are paired greedily by IoU (highest first, pairs need IoU ≥ 0.5 and the same class: in rows of
  six or more, the first column after the box holding whole numbers on every reference row is the class, the
  others are scores). Figures:
  `detections_found` (the share of the float model's detections the result also made), `detections_extra` (the
  share of the result's detections the float model did not make), `match_rate` (2 × pairs / (reference rows +
  result rows), which weighs both: 1 when both sides found the same boxes, also when both found none),
  `mean_iou` of the pairs, `score_abs_error` (the largest difference in the score columns, over the pairs).
  Box columns are x1 y1 x2 y2 when every reference row has x2 ≥ x1 and y2 ≥ y1, else cx cy w h.
- `ranked` (float values: TopK values, NMS scores): both sides sorted, compared over their common length:
  relative error (and max abs error) of the sorted values.
- `ranked_ids` (integer rows: TopK indices, NMS selected_indices): the rows as sets, `set_agreement` = |A ∩ B|
  / |A ∪ B| (1 when both are empty).
"""

from __future__ import annotations

import math

import numpy as np

MIN_IOU = 0.5


def compare_rows(reference: list, result: list, kind: str) -> dict:
    """The figures of `kind` ("boxes", "ranked", "ranked_ids") over the samples (see the module doc)."""
    per_sample = [_compare_one(np.asarray(a), np.asarray(b), kind) for a, b in zip(reference, result)]
    counted = sum(np.asarray(a).shape[:1] != np.asarray(b).shape[:1] for a, b in zip(reference, result))
    metrics: dict = {"samples": len(per_sample), **({"count_changed": counted} if counted else {})}
    if kind == "boxes":
        pairs = sum(s["pairs"] for s in per_sample)
        rows = sum(s["rows"] for s in per_sample)
        found, made = sum(s["reference_rows"] for s in per_sample), sum(s["result_rows"] for s in per_sample)
        ious = [iou for s in per_sample for iou in s["ious"]]
        errors = [e for s in per_sample for e in s["score_errors"]]
        metrics.update(match_rate=2 * pairs / rows if rows else 1.0,
                       detections_found=pairs / found if found else 1.0,
                       detections_extra=(made - pairs) / made if made else 0.0,
                       mean_iou=float(np.mean(ious)) if ious else None,
                       score_abs_error=float(max(errors)) if errors else None)
        metrics["score"] = metrics["match_rate"] * (metrics["mean_iou"] if ious else 1.0)
        values, name, higher = [s["match_rate"] for s in per_sample], "match rate", True
    elif kind == "ranked":
        signal = sum(s["signal"] for s in per_sample)
        noise = sum(s["noise"] for s in per_sample)
        metrics["rel_error"] = (0.0 if noise == 0 else math.sqrt(noise / signal) if signal > 0 else math.inf)
        metrics["max_abs"] = max((s["max_abs"] for s in per_sample), default=0.0)
        values, name, higher = [s["max_abs"] for s in per_sample], "max abs error (sorted)", False
    else:
        shared = sum(s["shared"] for s in per_sample)
        union = sum(s["union"] for s in per_sample)
        metrics["set_agreement"] = metrics["score"] = shared / union if union else 1.0
        values, name, higher = [s["set_agreement"] for s in per_sample], "set agreement", True
    metrics["per_sample"] = {"metric": name, "higher_is_better": higher, "values": values}
    return metrics


def _compare_one(a: np.ndarray, b: np.ndarray, kind: str) -> dict:
    if kind == "boxes":
        return _match_boxes(_as_rows(a), _as_rows(b))
    if kind == "ranked":
        x = -np.sort(-np.nan_to_num(a.astype(np.float64).ravel(), nan=-np.inf))
        y = -np.sort(-np.nan_to_num(b.astype(np.float64).ravel(), nan=-np.inf))
        n = min(x.size, y.size)
        x, y = np.where(np.isfinite(x[:n]), x[:n], 0.0), np.where(np.isfinite(y[:n]), y[:n], 0.0)
        return {"signal": float(np.sum(x ** 2)), "noise": float(np.sum((x - y) ** 2)),
                "max_abs": float(np.max(np.abs(x - y), initial=0.0))}
    rows_a = {tuple(r) for r in _as_rows(a).tolist()}
    rows_b = {tuple(r) for r in _as_rows(b).tolist()}
    union = len(rows_a | rows_b)
    return {"shared": len(rows_a & rows_b), "union": union,
            "set_agreement": len(rows_a & rows_b) / union if union else 1.0}


def _as_rows(values: np.ndarray) -> np.ndarray:
    """[rows, columns]: a leading batch of 1 dropped, a 1-D output one column."""
    values = np.asarray(values)
    while values.ndim > 2 and values.shape[0] == 1:
        values = values[0]
    return values.reshape(-1, values.shape[-1]) if values.ndim >= 2 else values.reshape(-1, 1)


def box_like(values: list) -> bool:
    """Do the first four columns read as boxes on every sample: x1 y1 x2 y2 (x2 ≥ x1, y2 ≥ y1) or cx cy w h
    (w, h ≥ 0), all finite? (Rows after NMS/TopK that are not boxes are ranked values.)"""
    for value in values:
        rows = _as_rows(np.asarray(value, dtype=np.float64))
        if rows.shape[-1] < 4:
            return False
        box = rows[:, :4]
        if not np.isfinite(box).all():
            return False
        corners = np.all(box[:, 2] >= box[:, 0]) and np.all(box[:, 3] >= box[:, 1])
        if not (corners or np.all(box[:, 2:4] >= 0)):
            return False
    return True


def class_column(ref: np.ndarray) -> int | None:
    """The column after the box that holds a class (whole numbers on every reference row), or None. Only rows
    with a score beside it have one: a lone fifth column of whole numbers is a score that rounds (1.0)."""
    if not len(ref) or ref.shape[1] < 6:
        return None
    columns = [c for c in range(4, ref.shape[1]) if np.all(np.mod(ref[:, c].astype(np.float64), 1) == 0)]
    return columns[0] if columns else None


def _match_boxes(ref: np.ndarray, res: np.ndarray) -> dict:
    """Greedy IoU pairing of reference and result rows (highest IoU first, IoU ≥ MIN_IOU, same class)."""
    rows = len(ref) + len(res)
    ious, errors = [], []
    if len(ref) and len(res):
        xyxy = bool(np.all(ref[:, 2] >= ref[:, 0]) and np.all(ref[:, 3] >= ref[:, 1]))
        table = iou_table(_corners(ref[:, :4], xyxy), _corners(res[:, :4], xyxy))
        label = class_column(ref)
        scores = [c for c in range(4, ref.shape[1]) if c != label]
        if label is not None:  # another class is another detection, however well the boxes overlap
            table = np.where(ref[:, label, None] == np.rint(res[None, :, label]), table, 0.0)
        order = np.dstack(np.unravel_index(np.argsort(-table, axis=None), table.shape))[0]
        used_a, used_b = set(), set()
        for i, j in order:
            if table[i, j] < MIN_IOU:
                break
            if i in used_a or j in used_b:
                continue
            used_a.add(i)
            used_b.add(j)
            ious.append(float(table[i, j]))
            if scores:
                errors.append(float(np.max(np.abs(ref[i, scores].astype(np.float64) - res[j, scores]))))
    return {"pairs": len(ious), "rows": rows, "reference_rows": len(ref), "result_rows": len(res), "ious": ious,
            "score_errors": errors, "match_rate": 2 * len(ious) / rows if rows else 1.0}


def _corners(boxes: np.ndarray, xyxy: bool) -> np.ndarray:
    boxes = boxes.astype(np.float64)
    if xyxy:
        return boxes
    centre, size = boxes[:, :2], np.abs(boxes[:, 2:4]) / 2
    return np.concatenate([centre - size, centre + size], axis=1)


def iou_table(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of every box in a [n, 4] with every box in b [m, 4] (x1 y1 x2 y2)."""
    low = np.maximum(a[:, None, :2], b[None, :, :2])
    high = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.prod(np.clip(high - low, 0, None), axis=-1)
    area_a = np.prod(np.clip(a[:, 2:] - a[:, :2], 0, None), axis=-1)
    area_b = np.prod(np.clip(b[:, 2:] - b[:, :2], 0, None), axis=-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.where(union > 0, union, 1), 0.0)
