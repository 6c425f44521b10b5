#!/usr/bin/env bash
# Install Debian's chromium for the docs' browser test (tests/unit/test_docs_browser.py opens
# the built site in it through Playwright, which the `docs` extra installs). Runs apt-get, so
# only as root; otherwise, or with GRADSYNC_SKIP_BROWSER_INSTALL=1, it says why it did nothing
# and the browser test is skipped with the reason. Never fails the caller.
set -uo pipefail
if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
  echo "Chromium: installed"
  exit 0
fi
if [ -n "${GRADSYNC_SKIP_BROWSER_INSTALL:-}" ]; then
  echo "Chromium: not installed (GRADSYNC_SKIP_BROWSER_INSTALL is set): the browser test will be skipped"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "Chromium: not installed (installing it needs root): the browser test will be skipped"
  exit 0
fi
if ! command -v apt-get >/dev/null; then
  echo "Chromium: not installed (no apt-get: the test uses Debian's chromium): the browser test will be skipped"
  exit 0
fi
echo "Chromium: installing chromium and fonts-liberation with apt-get"
log=$(mktemp)
if DEBIAN_FRONTEND=noninteractive apt-get update -q >"$log" 2>&1 \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium fonts-liberation >>"$log" 2>&1; then
  rm -f "$log"
  echo "Chromium: installed"
else
  tail -n 20 "$log" >&2
  rm -f "$log"
  echo "Chromium: apt-get failed (above): the browser test will be skipped"
fi
exit 0
