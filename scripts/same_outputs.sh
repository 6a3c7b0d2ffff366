#!/usr/bin/env bash
# Every shipped config run on a base commit and on this checkout: the model.onnx sha256 of each must be equal
# (a change that should not touch results, proven on the real demo models). The .rknn is not compared: the
# toolkit writes other bytes on every build of the same model.
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
printf '%-22s %-6s %-6s %-18s %-18s %s\n' config exit:b exit:h base head same
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
  [ "$same" = yes ] || status=1
  printf '%-22s %-6s %-6s %-18s %-18s %s\n' "$name" "$rc_base" "$rc_head" "$sha_base" "$sha_head" "$same"
done
exit $status
