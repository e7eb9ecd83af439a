#!/usr/bin/env bash
# A full-page PNG of a kbv HTML report, to look at (issue 16: the demo's report as a screenshot).
#
#   bash benchmarks/report_screenshot.sh REPORT.html OUT.png [HEIGHT]
#
# Headless Debian Chromium (/usr/bin/chromium) with the flags this closed network needs: without
# the background-networking ones it keeps trying to reach outside hosts.
set -eu
html=$(realpath "$1"); png=$2; height=${3:-9000}
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
timeout 90 chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --window-size="1400,$height" --screenshot="$png" "file://$html" \
    >/dev/null 2>&1
echo "$png"
