#!/usr/bin/env bash
# Local launcher: creates/uses ./.venv, installs the project, then runs one job.
#   launch/local.sh demo   [gin overrides...]  CPU RL demo (sparse-rollout GRPO on the synthetic task)
#   launch/local.sh test   [pytest args...]    the test suite as CI runs it (not `slow`; every `guard`)
#   launch/local.sh test --all [pytest args]   every test, the slow ones too
#   launch/local.sh sparrow <subcommand> ...   any CLI command inside the venv
set -euo pipefail
cd "$(dirname "$0")/.."
SPARROW_LAUNCHER=local.sh
# shellcheck source=launch/lib.sh
. launch/lib.sh
if [ ! -x .venv/bin/python ]; then
  PY=$(sparrow_find_python)      # Python >= 3.11 (PYTHON=... to choose), or one clear line
  echo "[local.sh] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.sparrow-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  # A .venv linked from another checkout (git worktree) keeps its own editable install.
  sparrow_refuse_shared_venv "$(pwd -P)/.venv/bin/python" "$(pwd -P)"
  echo "[local.sh] installing sparrow-jax and test dependencies into .venv"
  python -m pip install -q --upgrade pip
  # torch==2.13.0 first: it resolves to the local CPU wheel (no CUDA downloads).
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -c launch/constraints.txt -e ".[test]"   # the tested jax (one place)
  touch "$stamp"
fi
export JAX_PLATFORMS=${JAX_PLATFORMS:-cpu}
job=${1:-demo}; shift || true
case "$job" in
  demo)
    exec sparrow train configs/demo_cpu.gin "$@" ;;
  test)
    # The compile-only toolchains (.ci/compile_env.sh: ~2 GB of wheels, minutes of downloading on a
    # fresh clone, a no-op when up to date) install in the background while the tests that need
    # none run; the compile tests wait for the exit status it leaves in $SPARROW_COMPILE_ENV_DONE
    # (tests/hf_fixtures.require_compile_env).
    ce_dir=$(mktemp -d "${TMPDIR:-/tmp}/sparrow-compile-env-install.XXXXXX")
    export SPARROW_COMPILE_ENV_LOG="$ce_dir/install.log" SPARROW_COMPILE_ENV_DONE="$ce_dir/exit_status"
    ( set +e; bash .ci/compile_env.sh > "$SPARROW_COMPILE_ENV_LOG" 2>&1; echo $? > "$SPARROW_COMPILE_ENV_DONE.tmp"
      mv "$SPARROW_COMPILE_ENV_DONE.tmp" "$SPARROW_COMPILE_ENV_DONE" ) &
    ce_pid=$!
    set +e
    # Two workers, one test file per worker at a time (module fixtures stay shared): most tests
    # keep one core busy (tracing, compiling, Python), so two of them fill a 2-core machine.
    # SPARROW_TEST_WORKERS=0 runs in one process (e.g. with pdb).
    # --durations: every CI log names its 30 slowest tests (the suite has a time budget).
    # Default selection: every test except the `slow` ones, and every `guard` even when slow
    # (CI's budget is ~25 minutes on 2 cores). `--all` runs everything; a `-m` of your own wins.
    select=(-m "not slow or guard"); args=()
    for a in "$@"; do
      case "$a" in
        --all) select=() ;;
        -m|-m*) select=(); args+=("$a") ;;
        *) args+=("$a") ;;
      esac
    done
    [ ${#select[@]} -eq 0 ] || echo "[local.sh] running the tests not marked slow, and every guard (--all: the whole suite)"
    python -m pytest -n "${SPARROW_TEST_WORKERS:-2}" --dist loadfile --durations=30 \
      ${select[@]+"${select[@]}"} ${args[@]+"${args[@]}"}
    rc=$?
    if ! [ -f "$SPARROW_COMPILE_ENV_DONE" ]; then
      echo "[local.sh] waiting for the compile environment's install to finish ($SPARROW_COMPILE_ENV_LOG)"
    fi
    wait "$ce_pid"
    grep -v "^WARNING: Location" "$SPARROW_COMPILE_ENV_LOG" | sed 's/^/[compile_env log] /'
    if [ "$(cat "$SPARROW_COMPILE_ENV_DONE" 2>/dev/null)" != "0" ]; then
      echo "[local.sh] installing the compile environment failed (log above)"; [ $rc -ne 0 ] || rc=1
    fi
    rm -rf "$ce_dir"
    # pytest exit 5 = no tests collected: that is a failure for us, never a silent pass.
    if [ $rc -eq 5 ]; then echo "[local.sh] pytest collected no tests: failing"; exit 1; fi
    exit $rc ;;
  sparrow)
    exec sparrow "$@" ;;
  *)
    echo "usage: launch/local.sh {demo|test|sparrow ...}" >&2; exit 2 ;;
esac
