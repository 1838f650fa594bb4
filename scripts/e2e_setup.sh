#!/usr/bin/env bash
# Make sure Debian's chromium is at /usr/bin/chromium for the browser end-to-end test (tests/app/test_e2e.py).
# Playwright drives this system browser; no browser is downloaded by Playwright itself.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    echo "e2e_setup: chromium present: $(/usr/bin/chromium --version 2>/dev/null || echo unknown version)"
    exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update
$SUDO apt-get install -y --no-install-recommends chromium fonts-dejavu-core
/usr/bin/chromium --version
