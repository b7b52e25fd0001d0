# shellcheck shell=bash
# pick_python.sh -- which Python the shell scripts run, and whether it has what they need.
# Sourced by run.sh and plot_results.sh (it runs nothing by itself), so that both answer alike:
#
#   source "$REPO/pick_python.sh"
#   PYTHON=$(pick_python "$REPO")          # or: pick_python "$REPO" yes, inside a container
#   require_modules "$PYTHON" pandas matplotlib

# The interpreter: $PYTHON if set; inside a container (second argument yes) the image's own
# python, since a host virtual environment does not work inside it; else the active virtual
# environment's; else the repository's .venv (first argument: the repository); else python3.
pick_python() {
    local repo=$1 in_container=${2:-no}
    if [ -n "${PYTHON:-}" ]; then
        echo "$PYTHON"
    elif [ "$in_container" = yes ]; then
        echo python
    elif [ -n "${VIRTUAL_ENV:-}" ]; then
        echo "$VIRTUAL_ENV/bin/python"
    elif [ -x "$repo/.venv/bin/python" ]; then
        echo "$repo/.venv/bin/python"
    else
        echo python3
    fi
}

# Ends the script with one error: line and exit status 2 unless the Python $1 runs and can
# import every module named after it (before `make install`, python3 has no torch or pandas).
require_modules() {
    local python=$1 missing
    shift
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "error: no Python '$python' to run: run 'make install', or set PYTHON" >&2
        exit 2
    fi
    missing=$("$python" -c 'import importlib.util, sys
print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@" \
        2>/dev/null) || missing="$*"
    if [ -n "$missing" ]; then
        echo "error: $python cannot import ${missing// /, }: run 'make install', or set PYTHON" \
             "to a Python that has them" >&2
        exit 2
    fi
}
