#!/usr/bin/env bash
# Every shipped config run on a base commit and on this checkout: the model.onnx sha256 of each must be equal,
# and report.json's stage records and evaluation too, clock and machine left out (scripts/same_report.py): a
# change that should not touch results, proven on the real demo models — the fallback's trials and float set
# included. The .rknn is not compared: the toolkit writes other bytes on every build of the same model.
#   scripts/same_outputs.sh BASE_COMMIT [CONFIG...]      (default: configs/*.yaml; needs ./scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${1:?usage: scripts/same_outputs.sh BASE_COMMIT [CONFIG...]}
shift
CONFIGS=("$@")
[ ${#CONFIGS[@]} -gt 0 ] || CONFIGS=("$ROOT"/configs/*.yaml)
WORK=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$WORK/base" >/dev/null 2>&1 || true; rm -rf "$WORK"' EXIT
git -C "$ROOT" worktree add -q --detach "$WORK/base" "$BASE"
ln -s "$ROOT/models" "$WORK/base/models"   # the demo models setup.sh fetched (not in git)
status=0
printf '%-22s %-6s %-6s %-18s %-18s %-5s %s\n' config exit:b exit:h base head same report
for cfg in "${CONFIGS[@]}"; do
  cfg=$(realpath "$cfg"); name=$(basename "$cfg" .yaml)
  for side in base head; do
    code=$([ $side = base ] && echo "$WORK/base" || echo "$ROOT")
    # `python -m qprep` from the checkout's folder imports that checkout's qprep (and its worker processes too)
    (cd "$code" && "$ROOT/.venv/bin/python" -m qprep run "$cfg" --out "$WORK/$side/$name" --quiet \
        >"$WORK/$side.$name.log" 2>&1) && rc=0 || rc=$?
    eval "rc_$side=$rc"
    eval "sha_$side=$(sha256sum "$WORK/$side/$name/model.onnx" 2>/dev/null | cut -c1-16 || echo none)"
  done
  same=$([ "$sha_base" = "$sha_head" ] && [ "$sha_base" != none ] && echo yes || echo NO)
  report=$("$ROOT/.venv/bin/python" "$ROOT/scripts/same_report.py" "$WORK/base/$name/report.json" \
      "$WORK/head/$name/report.json" >"$WORK/report.$name.diff" 2>&1 && echo yes || echo NO)
  [ "$same" = yes ] && [ "$report" = yes ] || status=1
  printf '%-22s %-6s %-6s %-18s %-18s %-5s %s\n' "$name" "$rc_base" "$rc_head" "$sha_base" "$sha_head" "$same" "$report"
  [ "$report" = yes ] || sed 's/^/    /' "$WORK/report.$name.diff" | head -20
done
exit $status
