#!/usr/bin/env bash
# Run steplens' gpu-marked tests and GPU recordings on an NVIDIA GPU host whose python3 has CUDA torch
# (the device machine lent to some sessions: bench/README.md "GPU host"). Every step runs under `timeout`, with
# its log in $OUT, so a hang shows where it hung instead of eating the whole call.
#
#   OUT=/tmp/out bash bench/gpu_device.sh [tests] [record] [frlive] [cupti] [live] [kernel]      (default: tests record)
#
# Packages python3 lacks (cupti-python, sqlite-utils, lightgbm, ...) are installed from ./.whl/*.whl if present.
set -u
OUT=${OUT:-/tmp/steplens-gpu-out}
mkdir -p "$OUT"
what=${*:-tests record}
cd "$(dirname "$0")/.."

if [ ! -e .venv/.gpuhost ]; then
  rm -rf .venv
  python3 -m venv --system-site-packages .venv
  # python3 may itself be a venv (/opt/torch/.venv there): its packages are not the "system" ones, so link them
  sp=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "$sp" >"$(.venv/bin/python -c 'import site; print(site.getsitepackages()[0])')/gpuhost-python3.pth"
  if ls .whl/*.whl >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -3
  fi
  .venv/bin/python -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  touch .venv/.gpuhost
fi
.venv/bin/python -c "import steplens.agent.sources.gpu, torch; print('torch', torch.__version__, torch.cuda.is_available())" \
  2>&1 | tee "$OUT/setup.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/setup.log"

run_test() {   # FILE SECONDS
  local f=$1 s=$2 name
  name=$(basename "$f" .py)
  local t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 "$s" .venv/bin/python -m pytest -p no:cacheprovider -m gpu -v -s -rs \
    -o faulthandler_timeout=100 "$f" >"$OUT/$name.log" 2>&1
  echo "== $f rc=$? in $((SECONDS - t0)) s"
  grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/$name.log" | tail -8
}

case " $what " in *" tests "*)
  run_test tests/test_source_gpu.py 90
  run_test tests/test_bootstrap.py 120
  run_test tests/test_gpu_live.py 330
;; esac

case " $what " in *" record "*)
  t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 120 .venv/bin/python tests/fixtures/gpu-recorded/record_nvml.py "$OUT/nvml" \
    >"$OUT/record_nvml.log" 2>&1
  echo "== record_nvml rc=$? in $((SECONDS - t0)) s"; tail -3 "$OUT/record_nvml.log"
;; esac

case " $what " in *" frlive "*)
  t0=$SECONDS; rm -rf /tmp/frlive
  PYTHONUNBUFFERED=1 timeout -k 10 180 .venv/bin/python tests/fixtures/gpu-recorded/record_fr_live.py /tmp/frlive \
    >"$OUT/record_fr_live.log" 2>&1
  echo "== record_fr_live rc=$? in $((SECONDS - t0)) s"; grep -v "^\[" "$OUT/record_fr_live.log" | tail -14
  tar -C /tmp -czf "$OUT/frlive.tgz" frlive
;; esac

case " $what " in *" cupti "*)
  t0=$SECONDS
  PYTHONUNBUFFERED=1 timeout -k 10 300 .venv/bin/python tests/fixtures/gpu-recorded/record_cupti_phases.py "$OUT/cupti" \
    >"$OUT/record_cupti.log" 2>&1
  echo "== record_cupti_phases rc=$? in $((SECONDS - t0)) s"; tail -20 "$OUT/record_cupti.log"
  gzip -f "$OUT"/cupti/*.jsonl 2>/dev/null
;; esac

case " $what " in *" live "*)
  run_test tests/test_gpu_live.py 330
;; esac

case " $what " in *" kernel "*)   # the kernel-facing CPU tests, on this host's kernel (netem, cgroup v2, PSI)
  for f in tests/test_source_tcpinfo.py tests/test_source_host_causes.py tests/test_bootstrap_gc.py; do
    t0=$SECONDS; name=$(basename "$f" .py)
    PYTHONUNBUFFERED=1 timeout -k 10 200 .venv/bin/python -m pytest -p no:cacheprovider -v -rs "$f" >"$OUT/$name.log" 2>&1
    echo "== $f rc=$? in $((SECONDS - t0)) s"; grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$OUT/$name.log" | tail -14
  done
  uname -r; (tc qdisc add dev lo root netem loss 1% && tc qdisc del dev lo root && echo netem ok) 2>&1 | tail -1
;; esac
