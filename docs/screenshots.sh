#!/usr/bin/env bash
# Redo the README's pictures (docs/img/*.png): the demo's logs in a real TensorBoard, shot by
# headless Chromium (Debian's `chromium` package). Not part of CI.
#   docs/screenshots.sh [python]      # default .venv/bin/python (./dev demo sets it up)
set -euo pipefail
cd "$(dirname "$0")/.."
py="${1:-.venv/bin/python}"
tmp="$(mktemp -d)"
tb=""
trap '[ -n "$tb" ] && kill "$tb" 2>/dev/null; rm -rf "$tmp"' EXIT
PYTHONPATH=. "$py" examples/demo.py --log-dir "$tmp/runs/demo" >/dev/null
"$py" -m tensorboard.main --logdir "$tmp/runs/demo" --host 127.0.0.1 --port 0 >"$tmp/tb.log" 2>&1 &
tb=$!
for _ in $(seq 300); do url=$(grep -o 'http://127.0.0.1:[0-9]*' "$tmp/tb.log" || true); [ -n "$url" ] && break; sleep 0.2; done
[ -n "$url" ] || { cat "$tmp/tb.log" >&2; exit 1; }
sleep 5  # the first load of the logs
shot() {  # tab, file
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,1000 \
    --virtual-time-budget=20000 --screenshot="$2" "$url/#$1" 2>/dev/null
  echo "$2: $(du -k "$2" | cut -f1) KB"
}
shot custom_scalars docs/img/custom-scalars.png
shot scalars docs/img/scalars.png
