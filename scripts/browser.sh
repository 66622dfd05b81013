#!/usr/bin/env bash
# The console's browser tests drive Debian's chromium through Playwright (launched with executable_path; Playwright
# never downloads a browser of its own). Installs the package when /usr/bin/chromium is missing; prints its path.
set -euo pipefail
CHROMIUM=/usr/bin/chromium
if [ ! -x "$CHROMIUM" ]; then
    echo "browser: installing Debian's chromium" >&2
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q chromium >&2 || { $SUDO apt-get update -q >&2 && $SUDO apt-get install -y -q chromium >&2; }
fi
"$CHROMIUM" --version >&2
echo "$CHROMIUM"
