#!/usr/bin/env bash
# Screenshot a run folder's report.html with headless Chromium (for README's sample report).
#
#   scripts/screenshot-report.sh RUN_DIR [OUT.png] [--full] [--width PX] [--height PX]
#
# Default: the first screen (what a reader sees first: the answer to the recipe's question, one user,
# the offered load, the cost and the answers kept), 1100 x 900 px, written to RUN_DIR/report.png.
# --full takes the whole page (its height is read from the rendered page). Needs chromium (Debian:
# apt-get install -y chromium).
set -euo pipefail

usage() { sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
[ $# -ge 1 ] || usage
run_dir=$1; shift
out=""
full=0
width=1100
height=900
while [ $# -gt 0 ]; do
    case $1 in
        --full) full=1 ;;
        --width) width=$2; shift ;;
        --height) height=$2; shift ;;
        -h|--help) usage ;;
        -*) echo "screenshot-report: unknown option $1" >&2; usage ;;
        *) out=$1 ;;
    esac
    shift
done
report="$run_dir/report.html"
[ -f "$report" ] || { echo "screenshot-report: $report not found: give a run folder (fractal-opt run ... --out DIR)" >&2; exit 2; }
out=${out:-$run_dir/report.png}
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "screenshot-report: chromium not found; install it (Debian: apt-get install -y chromium)" >&2; exit 2; }

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking
       --disable-component-update --disable-sync --hide-scrollbars "--user-data-dir=$profile")
url="file://$(cd "$(dirname "$report")" && pwd)/report.html"
if [ "$full" -eq 1 ]; then
    # The page records its laid-out height on <html data-page-height> (fractal_opt/report/html.py's script).
    height=$("$browser" "${flags[@]}" "--window-size=$width,1000" --dump-dom "$url" 2>/dev/null \
        | grep -o 'data-page-height="[0-9]*"' | head -1 | grep -o '[0-9]*' || true)
    [ -n "$height" ] || { echo "screenshot-report: could not read the page height; is $report from fractal_opt?" >&2; exit 1; }
fi
"$browser" "${flags[@]}" "--window-size=$width,$height" "--screenshot=$out" "$url" 2>/dev/null
[ -s "$out" ] || { echo "screenshot-report: chromium wrote no screenshot" >&2; exit 1; }
echo "screenshot-report: $out ($width x $height px)"
