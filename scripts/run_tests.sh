#!/usr/bin/env bash
# Install the test environment in a virtual environment (.venv-test) and run the whole test suite.
#   bash scripts/run_tests.sh [pytest args]
# SGLang 0.5.23 is installed with --no-deps: its real modules run on the CPU for the integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MOEPLACE_TEST_VENV:-.venv-test}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q --disable-pip-version-check -r requirements-test.txt
"$py" -m pip install -q --disable-pip-version-check --no-deps sglang==0.5.23
"$py" -m pip install -q --disable-pip-version-check --no-deps -e .
set +e
"$py" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
