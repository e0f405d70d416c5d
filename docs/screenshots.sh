#!/usr/bin/env bash
# Redo the pictures of README.md and docs/tensorboard.md (docs/img/*.png): the demo's logs in a real
# TensorBoard on 127.0.0.1, shot by headless Chromium (Debian: `apt-get install -y chromium`). Not
# part of CI (a browser is slow to install and to start there); look at each picture after a change
# to the layout, as a newcomer would: can you tell where the step goes, and which line is which, in
# one look?
#   docs/screenshots.sh [python]      # default .venv/bin/python (./dev demo sets it up)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
browser="$(command -v chromium || command -v chromium-browser || true)"
[ -n "$browser" ] || { echo "screenshots.sh: no chromium (Debian: apt-get install -y chromium)" >&2; exit 1; }
tmp="$(mktemp -d)"
tb=""
trap '[ -n "$tb" ] && kill "$tb" 2>/dev/null; rm -rf "$tmp"' EXIT
# Three demo runs, as `./dev demo` three times writes them; two of them alone, as after the second.
for n in 1 2 3; do
  OMP_NUM_THREADS=1 PYTHONPATH=. "$py" examples/demo.py --log-dir "$tmp/three/demo-$n" >/dev/null
done
mkdir "$tmp/two" && cp -a "$tmp/three/demo-1" "$tmp/three/demo-2" "$tmp/two/"
serve() {  # log dir: a TensorBoard on it, its address in $url
  [ -n "$tb" ] && kill "$tb" 2>/dev/null && wait "$tb" 2>/dev/null || true
  "$py" -m tensorboard.main --logdir "$1" --host 127.0.0.1 --port 0 >"$tmp/tb.log" 2>&1 &
  tb=$!
  url=""
  for _ in $(seq 300); do url=$(grep -o 'http://127.0.0.1:[0-9]*' "$tmp/tb.log" || true); [ -n "$url" ] && break; sleep 0.2; done
  [ -n "$url" ] || { cat "$tmp/tb.log" >&2; exit 1; }
  sleep 15  # the first load of the logs (every run)
}
mkdir -p docs/img
shot() {  # page, file; a new profile each time, so no setting of an earlier page carries over
  rm -rf "$tmp/profile" && mkdir "$tmp/profile"
  "$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$tmp/profile" --hide-scrollbars --window-size=1400,1000 \
    --virtual-time-budget=20000 --screenshot="$2" "$url/$1" 2>/dev/null
  echo "$2: $(du -k "$2" | cut -f1) KB"
}
# Time Series draws with WebGL, which headless Chromium without a GPU leaves blank: forceSVG (a
# TensorBoard flag) draws the same charts as SVG.
serve "$tmp/two"
shot "?forceSVG=true#timeseries" docs/img/time-series.png
shot "#scalars" docs/img/scalars.png
shot "#custom_scalars" docs/img/custom-scalars.png
# The runs told apart: TensorBoard's "color runs by" regex, ^([^/]+), one colour per log dir.
shot "?forceSVG=true&runColorGroup=regex:%5E(%5B%5E/%5D%2B)#timeseries" docs/img/two-runs.png
serve "$tmp/three"
shot "?forceSVG=true#timeseries" docs/img/three-runs.png
