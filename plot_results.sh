#!/usr/bin/env bash
# Collect the training logs into a CSV (summary table on stdout), then plot it.
#
#   ./plot_results.sh                  # newest sweep in logs/ -> results.csv -> plots/*.png
#                                      # and plots/report.md (table, figures, largest costs)
#   ./plot_results.sh --all-sweeps     # every sweep in logs/, merged (collect_results.py says so)
#   LOGS=logs/sweep-20261122-141500 OUT=old.csv PLOTS=old_plots ./plot_results.sh
#                                      # -> old.csv, its old_comm.csv etc., old_plots/*.png
#
# Options go to collect_results.py.
# Works from any directory: the defaults are the repository's logs/, results.csv and plots/;
# paths you give are taken from where you call it. Runs the Python run.sh runs (pick_python.sh:
# $PYTHON, else the active virtual environment's, else the repository's .venv, else python3);
# before `make install` it says so in one line. Opens the PNGs only where there is a viewer and
# a display.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=pick_python.sh
source "$here/pick_python.sh"
PYTHON=$(pick_python "$here")
require_modules "$PYTHON" pandas matplotlib
logs="${LOGS:-$here/logs}"
csv="${OUT:-$here/results.csv}"
plots="${PLOTS:-$here/plots}"

"$PYTHON" "$here/collect_results.py" --logs "$logs" --out "$csv" "$@"
# plot_results.py prints each PNG it wrote, one per line.
written="$("$PYTHON" "$here/plot_results.py" --csv "$csv" --out-dir "$plots" --report)"

echo
echo "results: $csv"
echo "plots:"
while read -r png; do echo "  $png"; done <<<"$written"
echo "report: $plots/report.md"

if command -v xdg-open >/dev/null 2>&1 && [[ -n "${DISPLAY:-}" ]]; then
    while read -r png; do
        xdg-open "$png" >/dev/null 2>&1 &
    done <<<"$written"
fi
