#!/usr/bin/env bash
# What we run on the GPU machine (device tool), in one place so anyone can rerun it:
#   bash tools/gpu_session.sh setup verify shape relay relay_chunks relay_async relay_nic decision plan_domain fetch_overlap spread peers guard tests cuda a2a deepep layer_cuda local limit cutlass meta reload_ab fetch_overlap_ab combine_ab prefetch_ab chunks replica_copy copy_kernels ep1 ep1_paths shared shared_ep8 planner gemm graphs capacity capacity_ep8 memory capacity_time moe_layer eval eval_rest scale fig15 fig16_layer train train_backends pp
# Needs the wheels of tools/device-wheels.sh in .whl/ (megatron-core, hydra, wandb, datasets, datasketch),
# and for `planner` the extension built here (python -c 'from topoep.planners.cuda import load_extension as l; l()'),
# carried as build/ext.
# Writes short logs and result files to $OUT (default /tmp/gpu_out).
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
source "$(dirname "$0")/../launch/env.sh"
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
export PYTHONPATH=/tmp/site:$TOPOEP_ROOT${PYTHONPATH:+:$PYTHONPATH}
TOPOEP_PYTHON=python3
cd "$TOPOEP_ROOT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
RUNS=/tmp/gpu_runs

short_log() {  # short_log DIR NAME [VAR=value ...] CMD...: runs CMD (through env), keeps its whole output in
  # $RUNS-NAME.log, prints "NAME: rc=... <its last line>" and writes its test outcomes, failures and sync counts to
  # $OUT/DIR/NAME.log; returns CMD's exit status
  local dir=$1 name=$2; shift 2; env "$@" > "$RUNS-$name.log" 2>&1; local rc=$?
  echo "$name: rc=$rc $(tail -1 "$RUNS-$name.log")"
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR|E  )|passed|failed|synchronising|Error" "$RUNS-$name.log" | head -60 \
    > "$OUT/$dir/$name.log"; return $rc
}

step_setup() {
  # WHEELS: the folder of wheels carried (default .whl; e.g. a copy without wandb where the carry limit is near)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${WHEELS:-.whl}"/*.whl
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import torch, megatron.core, hydra; print("torch", torch.__version__, "mcore", megatron.core.__version__)'
}

step_verify() {  # every GPU test at once, the first check after many changes (correctness only: the suites run side
  # by side, the one-process files in VERIFY_WORKERS pytest-xdist workers, which that machine's image has): the
  # one-process GPU test files with backend cuda at EP 1; backend cuda's tests at EP 8 as 2 domains of 4 (ranks sharing
  # the GPU) with copy-by-copy relay trees of 2; then the sync audits at EP 1 and at that EP 8. Whole logs into
  # $OUT/verify/, each test named as it ends (a test that skips here is listed there with its reason); a test over
  # VERIFY_TEST_TIMEOUT seconds fails with its stack (pytest-timeout) instead of holding the call. VERIFY_AUDIT=0
  # leaves the audits out, VERIFY_EP8=0 the EP 8 run
  mkdir -p "$OUT/verify"
  local one="tests/test_planner_cuda.py tests/test_spread_cuda.py tests/test_peers_cuda.py tests/test_guard_cuda.py
    tests/test_worth_triton.py tests/test_capacity_cuda.py tests/test_spill.py tests/test_stats_triton.py
    tests/test_symm_rows.py tests/test_weighting.py tests/test_cuda_layout.py tests/test_grouped_gemm.py
    tests/test_cutlass_wgrad.py tests/test_runtime_gpu.py tests/test_cuda_backend_gpu.py tests/test_bench_copy_kernels.py
    tests/test_bench_grouped_gemm.py tests/test_bench_guard_latency.py tests/test_bench_layer_limit.py
    tests/test_bench_replica_copy.py"
  local ep8="TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 TOPOEP_GPU_RELAY_SCHEDULE=async"
  local p1 p2 rc1 rc2
  # the pytest command of both suites: the whole limit, each test's own, every test named as it ends; at the limit
  # an interrupt (SIGINT), so that pytest still prints each failure's reason and its summary, then a kill 30 s later
  local run=(timeout -s INT -k 30 "${VERIFY_TIMEOUT:-420}" python3 -m pytest -v -rA -p no:benchmark
             --timeout "${VERIFY_TEST_TIMEOUT:-200}" --durations 10)
  # shellcheck disable=SC2086
  TOPOEP_GPU_WORLD=1 "${run[@]}" -n "${VERIFY_WORKERS:-8}" $one > "$OUT/verify/one_process.log" 2>&1 & p1=$!
  if [ "${VERIFY_EP8:-1}" = 1 ]; then
    # shellcheck disable=SC2086
    env $ep8 "${run[@]}" -n "${VERIFY_EP8_WORKERS:-2}" tests/test_cuda_backend_gpu.py \
      > "$OUT/verify/ep8_rpd4_relay2_async.log" 2>&1 & p2=$!
  else
    echo "VERIFY_EP8=0: left out" > "$OUT/verify/ep8_rpd4_relay2_async.log"; p2=
  fi
  wait $p1; rc1=$?; rc2=0; [ -n "$p2" ] && { wait $p2; rc2=$?; }
  echo "one-process GPU tests (EP 1): rc=$rc1 $(tail -1 "$OUT/verify/one_process.log")"
  echo "EP 8, 2 domains of 4, async relays of 2: rc=$rc2 $(tail -1 "$OUT/verify/ep8_rpd4_relay2_async.log")"
  grep -hE "(FAILED|ERROR) tests/" "$OUT"/verify/*.log | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | head -30
  [ "${VERIFY_AUDIT:-1}" = 1 ] || { [ $rc1 = 0 ] && [ $rc2 = 0 ]; return; }
  local rc3 rc4
  TOPOEP_GPU_WORLD=1 timeout -k 10 120 python3 tools/sync_audit.py > "$OUT/verify/audit_ep1.log" 2>&1
  audit_summary "sync audit EP 1" $? "$OUT/verify/audit_ep1.log"; rc3=$?
  # shellcheck disable=SC2086
  env $ep8 timeout -k 10 150 python3 tools/sync_audit.py > "$OUT/verify/audit_ep8.log" 2>&1
  audit_summary "sync audit EP 8 async relays" $? "$OUT/verify/audit_ep8.log"; rc4=$?
  [ $rc1 = 0 ] && [ $rc2 = 0 ] && [ $rc3 = 0 ] && [ $rc4 = 0 ]
}

step_tests() {  # GPU tests of the runtime (grouped GEMM, 2-GPU NCCL vs dense reference)
  python3 -m pytest -q -rA tests/test_runtime_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
}

step_cuda() {  # backend cuda on 2 GPUs: payloads, vs backend torch for every policy, no host sync, graph replay
  timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py 2>&1 | tail -25 \
    | tee "$OUT/cuda_backend_tests.log"
  timeout ${CUDA_TEST_TIMEOUT:-300} python3 tools/sync_audit.py 2>&1 | grep -v -i "userwarning\|warnings.warn" | tail -40 | tee "$OUT/sync_audit.log"
}

step_a2a() {  # backend cuda's NVSHMEM transport (a2a.py) with the 2 GPUs as 2 virtual domains: its GPU tests, then
  # one MoE layer on it beside the peer-pointer transport (bench/moe_layer.py --transport a2a)
  TOPOEP_GPU_TRANSPORT=a2a TOPOEP_GPU_RPD=$((NGPU / 2)) timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py 2>&1 \
    | tail -25 | tee "$OUT/cuda_backend_a2a_tests.log"
  [ "${A2A_BENCH:-1}" = 0 ] && return
  echo "bench start $(date +%T)"
  timeout ${A2A_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py \
    --name moe_layer_a2a --out "$OUT" --transport a2a --ranks-per-domain $((NGPU / 2)) --backends cuda \
    --tokens ${TOKENS:-4096} --no-megatron 2>&1 | grep -v -i warn | grep -E "^  [0-9]|Error|error" | tail -30
  echo "bench end $(date +%T) (report: $(ls "$OUT"/moe_layer_a2a.md 2>/dev/null))"
}

step_layer_cuda() {  # one MoE layer on backend cuda only (static, topoep; 2 and 8 slots; 4096 and 16384 tokens per
  # rank): the quick check of a change to the cuda path beside the bound (bench/moe_layer.py --name moe_layer_cuda*)
  for slots in 2 8; do
    local name=moe_layer_cuda; [ $slots = 2 ] || name=moe_layer_cuda_slots$slots
    timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py --name $name \
      --out "$OUT" --backends cuda --no-megatron --slots $slots --tokens ${TOKENS:-4096 16384} 2>&1 | grep -v -i warn \
      | grep -E "^  [0-9]|Error|error" | tail -30
  done
}

step_ep1() {  # on a one-GPU machine: backend cuda's GPU tests at EP 1 (every path but the copies between GPUs and
  # the replicas), the sync audit, and one layer at EP 1 with a torch.profiler table (what the local work costs)
  TOPOEP_GPU_WORLD=1 timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py \
    tests/test_weighting.py 2>&1 | tail -15 | tee "$OUT/cuda_backend_ep1_tests.log"
  TOPOEP_GPU_WORLD=1 timeout 120 python3 tools/sync_audit.py 2>&1 | grep -E "synchronising|Error"
  timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/moe_layer.py --name moe_layer_ep1 \
    --out "$OUT" --backends cuda --no-megatron --slots 2 --tokens 4096 16384 --skews 0 --layouts random \
    --profile-iters 2 --torch-profile 2>&1 | grep -E "^  [0-9]|Error|error" | tail -10
}

audit_summary() {  # audit_summary NAME RC LOG: the sync audit's exit status and every rank's line that found a
  # synchronising call (sync_audit.py exits 0 either way), else its last line
  local bad; bad=$(grep -E "synchronising" "$3" | grep -v ": 0 synchronising")
  echo "$1: rc=$2 ${bad:-$(grep -E "synchronising|Error" "$3" | tail -1)}"
  [ "$2" = 0 ] && [ -z "$bad" ]
}

step_local() {  # a change to backend cuda's local path, checked: LOCAL_PART=1 the GPU tests at EP 1 (quick kernel files
  # first; stops at the first failure) and their sync audit; LOCAL_PART=2 the EP 8 tests with the ranks sharing the
  # GPU (2 domains of 4: remote and local rows) and their sync audit. One device call each (each part takes 6-8 of
  # its 10 minutes); then step limit as a call of its own. A part fails on pytest's exit status, and says how many
  # tests skipped (a GPU test that skips here did not run)
  if [ "${LOCAL_PART:-1}" = 1 ]; then
    TOPOEP_GPU_WORLD=1 timeout -k 10 450 python3 -m pytest -q -x -rA tests/test_symm_rows.py tests/test_weighting.py \
      tests/test_spill.py tests/test_stats_triton.py tests/test_cuda_backend_gpu.py > "$RUNS.ep1" 2>&1
    local rc=$?
    cp "$RUNS.ep1" "$OUT/cuda_backend_ep1_tests.log"
    echo "EP 1: rc=$rc $(tail -1 "$RUNS.ep1"); skipped: $(grep -c "^SKIPPED" "$RUNS.ep1")"
    if [ $rc != 0 ]; then grep -E "Error|error|assert|FAILED" "$RUNS.ep1" | head -30; return 1; fi
    TOPOEP_GPU_WORLD=1 timeout -k 10 120 python3 tools/sync_audit.py > "$RUNS.audit1" 2>&1
    audit_summary "sync audit EP 1" $? "$RUNS.audit1" | tee "$OUT/sync_audit_ep1.log"
  fi
  if [ "${LOCAL_PART:-2}" = 2 ]; then
    (export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4
     CUDA_TEST_TIMEOUT=${CUDA_TEST_TIMEOUT:-420} shared_tests ep8_rpd4; shared_audit sync_audit_shared_ep8.log)
  fi
}

step_limit() {  # one layer at EP 1 against its physical limit (bench/layer_limit.py): GEMMs + HBM bytes measured in the
  # same run, our layer (static, topoep), a plain PyTorch MoE and megatron's; LIMIT_ARGS adds options (e.g. --profile)
  timeout ${LIMIT_TIMEOUT:-420} python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/layer_limit.py \
    --out "$OUT" ${LIMIT_ARGS:-} 2>&1 | grep -v -i warn | grep -E "^  [0-9]|^\||Error|error" | tail -60
}

step_cutlass() {  # CUTLASS's grouped GEMM under our tiles (topoep_research.cutlass_wgrad; build it here and carry
  # build/cutlass_wgrad_*): its GPU tests (kernels against torch._grouped_mm, the layer on them against the default),
  # the six GEMMs kernel by kernel, then the layer at EP 1 against its limit with and without them (LIMIT_ARGS adds
  # options, e.g. --cutlass-config 2 0)
  ls -d build/cutlass_wgrad_*/cutlass_wgrad.so || { echo "cutlass: no build carried (build/cutlass_wgrad_*)"; return 1; }
  timeout 300 python3 -m pytest -q -rA tests/test_cutlass_wgrad.py 2>&1 | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" \
    | tee "$OUT/cutlass_tests.log" | tail -3
  timeout ${GEMM_TIMEOUT:-420} python3 bench/grouped_gemm.py --out "$OUT" --name grouped_gemm_cutlass --cutlass \
    --configs 128,128,64,8,3 ${GEMM_ARGS:-} 2>&1 | grep -v -i warn | grep -E "^\||Error|error" | head -40
  timeout ${LIMIT_TIMEOUT:-420} python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/layer_limit.py \
    --out "$OUT" --name layer_limit_cutlass --no-megatron --iters 10 --cutlass ${LIMIT_ARGS:-} 2>&1 | grep -v -i warn \
    | grep -E "^  [0-9]|^\||Error|error" | tail -40
}

step_meta() {  # the metadata graph's kernels: backend cuda's GPU tests at EP 1 (stops at the first failure) and its sync
  # audit, then step limit at 4096 tokens with --meta-profile (the graph's kernels one by one; LIMIT_ARGS replaces the
  # options)
  TOPOEP_GPU_WORLD=1 timeout 300 python3 -m pytest -q -x -rA tests/test_cuda_backend_gpu.py tests/test_spill.py \
    tests/test_stats_triton.py tests/test_weighting.py 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" \
    | tee "$OUT/cuda_backend_ep1_tests.log" | tail -3
  TOPOEP_GPU_WORLD=1 timeout 100 python3 tools/sync_audit.py 2>&1 | grep -E "synchronising|Error" | tail -2
  LIMIT_ARGS="${LIMIT_ARGS:---no-megatron --iters 10 --meta-profile --tokens 4096}" step_limit
}

step_deepep() {  # transport deepep (DeepEP V2) on this machine's GPUs, from DEEPEP_DIR (default .deepep, carried):
  # deep_ep-*.whl (tools/build_deepep.sh; or deep_ep_site.tar.xz, the wheel unpacked), ext/topoep_planner.so
  # (optional: the planner extension built here), nccl/ (optional: an NCCL >= 2.30.4 tree, lib/libnccl.so.2[.xz] and include/,
  # put over the environment's nvidia-nccl, since DeepEP needs torch to load the NCCL it was built against) and DeepEP/
  # (optional: its source's tests). Then: torch and deep_ep import, DeepEP's own test at EP = all GPUs, backend cuda's
  # GPU tests with TOPOEP_GPU_TRANSPORT=deepep at EP = all GPUs, and with 2+ GPUs bench/moe_layer.py on deepep, a2a and
  # peer, side by side in moe_layer_deepep.md (bench/transports.py)
  local d=${DEEPEP_DIR:-.deepep} nccl
  nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])')
  if [ -d "$d/nccl/lib" ]; then
    [ -f "$d/nccl/lib/libnccl.so.2.xz" ] && xz -dc "$d/nccl/lib/libnccl.so.2.xz" > "$nccl/lib/libnccl.so.2"
    [ -f "$d/nccl/lib/libnccl.so.2" ] && cp "$d/nccl/lib/libnccl.so.2" "$nccl/lib/libnccl.so.2"
    cp -r "$d/nccl/include/." "$nccl/include/"
  fi
  if ls "$d"/deep_ep-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$d"/deep_ep-*.whl
  else  # the wheel unpacked and compressed (deep_ep_site.tar.xz: a third of the wheel's size to carry)
    mkdir -p /tmp/site && xz -dc "$d/deep_ep_site.tar.xz" | tar -C /tmp/site -xf -
  fi
  if [ -f "$d/ext/topoep_planner.so" ]; then  # the planner extension built here, carried alone
    local ext; ext=$(python3 -c 'from topoep.planners.cuda import build_dir; print(build_dir())')
    mkdir -p "$ext" && cp "$d/ext/topoep_planner.so" "$ext/"
  fi
  export CUDA_HOME=${CUDA_HOME:-$(ls -d /usr/local/cuda-1* | sort -V | tail -1)} EP_JIT_CACHE_DIR=${EP_JIT_CACHE_DIR:-/tmp/deepep_jit}
  export EP_DISABLE_GIN=${EP_DISABLE_GIN:-1}  # one host, no RDMA NIC: DeepEP's NVLink path only
  (cd /tmp && python3 -c 'import torch, deep_ep; print("torch NCCL", torch.cuda.nccl.version(), "deep_ep", deep_ep.__version__)') \
    2>&1 | tail -3 | tee "$OUT/deepep_import.log"
  if [ -d "$d/DeepEP/tests/elastic" ]; then
    (cd "$d/DeepEP" && timeout 300 python3 tests/elastic/test_ep.py --num-processes "$NGPU" \
      --num-tokens 512 --hidden 2048 --num-topk 8 --num-experts $((NGPU * 16)) --do-cpu-sync 0 --skip-perf-test \
      --test-first-only) > "$RUNS.deepep_own" 2>&1
    echo "DeepEP's test_ep.py: exit $?"; tail -5 "$RUNS.deepep_own" | tee "$OUT/deepep_own_test.log"
  fi
  TOPOEP_GPU_WORLD=$NGPU TOPOEP_GPU_TRANSPORT=deepep timeout 420 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py \
    ${DEEPEP_TESTS:+-k "$DEEPEP_TESTS"} > "$RUNS.deepep" 2>&1
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|Error" "$RUNS.deepep" | tee "$OUT/cuda_backend_deepep_tests.log" | tail -12
  [ "$NGPU" -ge 2 ] || return 0
  for tr in deepep a2a peer; do
    timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py \
      --name moe_layer_deepep_$tr --out "$OUT" --transport $tr --backends cuda --no-megatron --tokens ${TOKENS:-4096} \
      --skews 0 -4 2>&1 | grep -v -i warn | grep -E "^  [0-9]|Error|error" | tail -12
  done
  python3 bench/transports.py "$OUT" --results "$OUT" | tail -20  # the three side by side: moe_layer_deepep.md
}

step_gemm() {  # the experts' weight-gradient kernels (tests/test_grouped_gemm.py, and tests/test_cutlass_wgrad.py
  # where the CUTLASS kernel was built here and carried: build/cutlass_wgrad_*) against their reference and
  # torch._grouped_mm, then the six grouped GEMMs of a layer call kernel by kernel (bench/grouped_gemm.py; GEMM_ARGS
  # adds options, e.g. --inductor or --cutlass)
  timeout 300 python3 -m pytest -q -rA tests/test_grouped_gemm.py tests/test_cutlass_wgrad.py 2>&1 | tail -12 \
    | tee "$OUT/grouped_gemm_tests.log"
  timeout ${GEMM_TIMEOUT:-420} python3 bench/grouped_gemm.py --out "$OUT" ${GEMM_ARGS:-} 2>&1 | grep -v -i warn \
    | grep -E "^\||Error|error" | head -60
}

step_graphs() {  # whole-layer CUDA graphs (topoep.graph_layer, LayerConfig.layer_graphs): their GPU tests at EP 1 and
  # at EP 8 as 2 domains of 4 with the ranks sharing the GPU, then the trainer with eplb.layer_graphs in
  # GRAPHS_TRAINER (default "false true"; model=qwen3, backend cuda, STEPS steps: the same losses), then step limit
  # at 4096 tokens with the graphed layers
  TOPOEP_GPU_WORLD=1 timeout 300 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py -k graphed > "$RUNS.g1" 2>&1
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$RUNS.g1" | tee "$OUT/graphs_ep1_tests.log"
  if [ "${GRAPHS_EP8:-1}" = 1 ]; then  # GRAPHS_EP8=0: left out (step shared_ep8 and relay_chunks run these tests too)
    (export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4
     timeout -k 10 300 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py -k graphed > "$RUNS.g8" 2>&1)
    grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$RUNS.g8" | tee "$OUT/graphs_shared_ep8_tests.log"
  fi
  for g in ${GRAPHS_TRAINER:-false true}; do
    timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py model=qwen3 \
      trainer=default eplb=topoep eplb.backend=cuda eplb.layer_graphs=$g trainer.steps=${STEPS:-20} logger=none \
      trainer.run_dir=$RUNS/qwen3-graphs-$g > "$RUNS-qwen3-graphs-$g.log" 2>&1
    echo "== qwen3 eplb.layer_graphs=$g: exit $?"
    grep -E "^world|^step|Error|error" "$RUNS-qwen3-graphs-$g.log" | tee "$OUT/qwen3-layer-graphs-$g.log" | tail -3
  done
  LIMIT_ARGS="--no-megatron --iters 10 --graphed --tokens 4096 ${LIMIT_ARGS:-}" step_limit
}

step_ep1_paths() {  # on a one-GPU machine: backend cuda's GPU tests at EP 1 with the two-chunk pipeline
  # (TOPOEP_GPU_CHUNKS=2; its sync audit too) and with the second bank of replica slots (TOPOEP_GPU_PREFETCH=1):
  # their streams, events and layouts run, though at EP 1 nothing crosses GPUs and no replica is placed
  TOPOEP_GPU_CHUNKS=2 TOPOEP_GPU_WORLD=1 timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py 2>&1 | tail -15 | tee "$OUT/cuda_backend_ep1_chunks2_tests.log"
  TOPOEP_GPU_CHUNKS=2 TOPOEP_GPU_WORLD=1 timeout 120 python3 tools/sync_audit.py 2>&1 | grep -E "synchronising|Error"
  TOPOEP_GPU_PREFETCH=1 TOPOEP_GPU_WORLD=1 timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py 2>&1 | tail -15 | tee "$OUT/cuda_backend_ep1_prefetch_tests.log"
}

shared_tests() {  # shared_tests TAG [VAR=value ...]: backend cuda's GPU tests with the ranks sharing the GPU(s), with
  # the given variables; the log's tail to $OUT. Output goes to a file, not a pipe: a rank left behind by the
  # timeout would hold a pipe open until the call's own limit
  local tag=$1; shift
  env "$@" timeout -k 10 ${CUDA_TEST_TIMEOUT:-400} python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py \
    > "$RUNS.shared" 2>&1
  local rc=$?
  tail -25 "$RUNS.shared" > "$OUT/cuda_backend_shared_${tag}_tests.log"
  echo "$tag: rc=$rc $(tail -1 "$RUNS.shared"); skipped: $(grep -c "^SKIPPED" "$RUNS.shared")"
  return $rc
}

shared_audit() {  # shared_audit LOG [VAR=value ...]: the sync audit with the ranks sharing the GPU(s), appended to LOG
  # with its exit status (124: timed out)
  local log=$1 rc; shift
  env "$@" timeout -k 10 200 python3 tools/sync_audit.py > "$RUNS.audit" 2>&1
  rc=$?
  echo "rc=$rc sync audit ${*:-default}: $(grep -E "synchronising|Error" "$RUNS.audit" | tr '\n' ' ')" \
    | tee -a "$OUT/$log"
}

step_shared() (  # a subshell: its variables stay out of the steps after it. On a one-GPU machine: the 2-rank GPU
  # tests with both ranks on the one GPU (TOPOEP_GPU_SHARE=1, gloo process group; distributed.py's gpus_shared):
  # backend cuda at EP 2 with replicas placed, fetched, reloaded and their gradients returned, on one domain and on
  # 2 virtual domains, with the two-chunk pipeline and with the second bank of slots; the sync audit; backend
  # torch's 2-rank test. Correctness only: two ranks share one GPU's SMs and memory bandwidth, so nothing here is
  # timed. Not here: transport a2a, whose test hung with both ranks on one GPU (NVSHMEM's support for several
  # processes per GPU is limited without MPS): it skips when the GPUs are shared and needs 2 GPUs (step a2a)
  export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=2
  timeout -k 10 300 python3 tools/shared_gpu_probe.py > "$RUNS.probe" 2>&1
  grep -E "^(gloo|nccl) " "$RUNS.probe" | tee "$OUT/shared_probe.log"
  shared_tests peer_rpd2 TOPOEP_GPU_RPD=2
  shared_tests peer_rpd1 TOPOEP_GPU_RPD=1
  shared_tests chunks2_rpd2 TOPOEP_GPU_RPD=2 TOPOEP_GPU_CHUNKS=2
  shared_tests prefetch_rpd2 TOPOEP_GPU_RPD=2 TOPOEP_GPU_PREFETCH=1
  local v
  for v in "" TOPOEP_GPU_CHUNKS=2 TOPOEP_GPU_PREFETCH=1; do
    shared_audit sync_audit_shared.log $v
  done
  timeout -k 10 ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA tests/test_runtime_gpu.py > "$RUNS.shared" 2>&1
  tail -12 "$RUNS.shared" > "$OUT/runtime_gpu_shared_tests.log"
  echo "backend torch, 2 ranks: $(tail -1 "$RUNS.shared")"
)

step_shared_ep8() (  # a subshell, as step_shared. On a one-GPU machine: backend cuda's GPU tests at EP 8 as 2
  # virtual domains of 4, all 8 ranks on the one GPU (TOPOEP_GPU_SHARE=1), by default and with two chunks plus the
  # prefetch bank; the sync audit. Issue 10's EP-8 correctness set, short of its 8 GPUs: correctness only, nothing
  # timed
  export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4
  shared_tests ep8_rpd4
  shared_tests ep8_rpd4_chunks2_prefetch TOPOEP_GPU_CHUNKS=2 TOPOEP_GPU_PREFETCH=1
  shared_audit sync_audit_shared_ep8.log
)

ab_layer() {  # ab_layer NAME SLOTS "FLAGS" [bench args]: one layer at 4096 tokens per rank on backend cuda without
  # (=0) and with (=1) the bench flags FLAGS, interleaved twice (machines differ by several % from call to call:
  # compare inside one call)
  local name=$1 slots=$2 flags=$3; shift 3
  local rep v
  for rep in 1 2; do
    for v in 0 1; do
      # shellcheck disable=SC2046
      timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" \
        bench/moe_layer.py --name ${name}${v}_rep$rep --out "$OUT" --backends cuda --no-megatron --slots $slots \
        --tokens 4096 --profile-iters 0 $([ $v = 1 ] && echo "$flags") "$@" 2>&1 | grep -E "^  [0-9]|Error|error" \
        | sed "s/^/$flags=$v rep=$rep /"
    done
  done
}

step_reload_ab() {  # what the backward reload costs: a lone layer leaves it out (=0), an earlier layer of a deeper
  # model reloads (=1, --reload always); 8 slots
  ab_layer moe_layer_reload_always 8 "--reload always" --skews 0 -4 --layouts concentrated
}

step_prefetch_ab() {  # the backward prefetch: 4 chained layers (times per layer), one bank (=0: every layer but the
  # last reloads in backward) or two (=1: the last two keep their replicas, the others are prefetched beside the
  # next layer's backward); 8 slots
  ab_layer moe_layer_prefetch 8 "--prefetch" --depth 4 --skews 0 -4 --layouts concentrated
}

step_fetch_overlap_ab() {  # the forward fetch before the dispatch (=0, the default) or beside it and the main
  # experts' GEMMs (=1, LayerConfig.fetch_overlap); 8 slots; needs 2+ GPUs (ranks sharing one GPU time nothing)
  [ "$NGPU" -ge 2 ] || { echo "fetch_overlap_ab: needs 2+ GPUs, found $NGPU"; return 1; }
  ab_layer moe_layer_fetch_overlap 8 "--fetch-overlap" --skews 0 -4 --layouts concentrated
}

step_combine_ab() {  # the backward combine on the layer's stream (=0, the default) or beside the weight gradients (=1)
  ab_layer moe_layer_combine_side 8 "--combine-side-stream" --skews 0 -4 --layouts concentrated
}

step_chunks() {  # backend cuda with its tokens in two chunks (dispatch and combine on the comm stream beside the
  # GEMMs): the GPU tests, then one layer with 1 and 2 chunks, interleaved twice
  TOPOEP_GPU_CHUNKS=2 timeout ${CUDA_TEST_TIMEOUT:-300} python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py 2>&1 \
    | tail -15 | tee "$OUT/cuda_backend_chunks2_tests.log"
  ab_layer moe_layer_chunks 8 "--chunks 2" --tokens 4096 16384 --skews 0 -4 --layouts concentrated
}

step_copy_kernels() {  # the replica copy kernels on one GPU (HBM to HBM), 16-byte and one-element accesses, beside
  # torch's copy_ (bench/copy_kernels.py -> results/copy_kernels.md)
  timeout 120 python3 bench/copy_kernels.py --out "$OUT" 2>&1 | grep -v -i warn | grep -E "^\||Error|error|differs" | head -14
}

step_replica_copy() {  # the replica fetch and gradient push kernels' bandwidth for copy chunk sizes and warps, beside
  # copy engines (bench/replica_copy.py -> results/replica_copy.md)
  timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/replica_copy.py --out "$OUT" \
    2>&1 | grep -v -i warn | tail -40
}

step_planner() {  # CUDA planner: bit-equality with the reference, no host sync, graphs; Fig. 11 latency.
  # PLANNER_QUICK=1: one of the four chunks of random cases (600) and the other tests, for a first check of a
  # kernel change. The benchmark only runs when every test passed (a faulting kernel can hang it), and both
  # have a time limit, so that a broken build cannot use up a session's GPU time.
  local t=tests/test_planner_cuda.py
  local args=("$t")
  [ "${PLANNER_QUICK:-0}" = 1 ] && for c in 1 2 3; do args+=(--deselect "$t::test_cuda_plan_equals_reference[$c]"); done
  timeout ${PLANNER_TEST_TIMEOUT:-360} python3 -m pytest -q -rA "${args[@]}" > "$OUT/planner_tests_full.log" 2>&1
  local rc=$?
  grep -E "^(E  |FAILED|PASSED|[0-9]+ (passed|failed))|Error" "$OUT/planner_tests_full.log" | head -40 \
    | tee "$OUT/planner_tests.log"
  [ $rc = 0 ] || { echo "planner tests failed (rc $rc): no benchmark"; return; }
  [ "${PLANNER_BENCH:-1}" = 0 ] && return
  timeout ${PLANNER_BENCH_TIMEOUT:-240} python3 bench/planner_latency.py --profile --out "$OUT" 2>&1 | grep -v -i warn \
    | tail -30
}

step_shape() {  # the GPU tests after a change of the code's shape (config, package split, planner files), on one
  # GPU: the capacity and spill kernels, the planner's skip-stage test, backend cuda at EP 1 (with the runtime's GPU
  # tests and the sync audit), at EP 2 as 2 domains of 1 and at EP 8 as 2 domains of 4 with two chunks and the
  # prefetch bank, the ranks sharing the GPU. Short logs into $OUT/shape/ (step planner: the planner's full set)
  mkdir -p "$OUT/shape"
  _t() { local name=$1; shift; env "$@" > "$RUNS-$name.log" 2>&1; echo "$name: rc=$? $(tail -1 "$RUNS-$name.log")"
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|synchronising" "$RUNS-$name.log" > "$OUT/shape/$name.log"; }
  _t capacity_spill timeout 200 python3 -m pytest -q -rA tests/test_capacity_cuda.py tests/test_spill.py
  _t skip_test timeout 60 python3 -m pytest -q -rA \
    "tests/test_planner_cuda.py::test_skip_stages_time_a_valid_plan_and_stay_in_their_call"
  _t ep1 TOPOEP_GPU_WORLD=1 timeout 200 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py tests/test_weighting.py \
    tests/test_runtime_gpu.py
  _t audit_ep1 TOPOEP_GPU_WORLD=1 timeout 100 python3 tools/sync_audit.py
  _t ep2_shared_rpd1 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=2 TOPOEP_GPU_RPD=1 timeout -k 10 250 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py
  _t ep8_shared_rpd4_chunks2_prefetch TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_CHUNKS=2 \
    TOPOEP_GPU_PREFETCH=1 timeout -k 10 280 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
}

step_relay() {  # backend cuda's relayed replica transfers (LayerConfig.relay_fanout) on one GPU, the ranks sharing it:
  # EP 8 as 2 domains of 4 with fanout 2 (every GPU test, the relayed-vs-direct one included) and its sync audit,
  # fanout 1 (chains) with two chunks and the prefetch bank, and the direct path at EP 2 as 2 domains of 1 (its
  # kernels are the relayed ones with RELAY off). RELAY_PART=1 or 2 runs half (one device call each). Correctness
  # only. Short logs into $OUT/relay/
  mkdir -p "$OUT/relay"
  _r() { local name=$1; shift; env TOPOEP_GPU_SHARE=1 "$@" > "$RUNS-$name.log" 2>&1
    echo "$name: rc=$? $(tail -1 "$RUNS-$name.log")"
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|passed|failed|synchronising|Error" "$RUNS-$name.log" > "$OUT/relay/$name.log"; }
  if [ "${RELAY_PART:-1}" = 1 ]; then
    _r ep8_rpd4_relay2 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 timeout -k 10 280 python3 -m pytest -q -rA \
      tests/test_cuda_backend_gpu.py
    _r audit_ep8_rpd4_relay2 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 timeout -k 10 150 \
      python3 tools/sync_audit.py
  fi
  if [ "${RELAY_PART:-2}" = 2 ]; then
    _r ep8_rpd4_relay1_chunks2_prefetch TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=1 TOPOEP_GPU_CHUNKS=2 \
      TOPOEP_GPU_PREFETCH=1 timeout -k 10 280 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
    _r ep2_rpd1_direct TOPOEP_GPU_WORLD=2 TOPOEP_GPU_RPD=1 timeout -k 10 200 python3 -m pytest -q -rA \
      tests/test_cuda_backend_gpu.py
  fi
}

step_relay_chunks() {  # relay trees whose copies travel in chunks (LayerConfig.relay_chunks): the guard kernel's
  # tests (its chunked step model against the reference), then backend cuda's GPU tests at EP 8 as 2 domains of 4
  # (ranks sharing the GPU) with trees of 2 in 4 chunks (the relayed-vs-direct test runs 1, 3 and 4 chunks) and the
  # sync audit. Correctness only. Short logs into $OUT/relay_chunks/
  mkdir -p "$OUT/relay_chunks"
  _c() { short_log relay_chunks "$@"; }
  [ "${CHUNKS_KERNEL:-1}" = 1 ] && _c guard_kernel timeout -k 10 240 python3 -m pytest -q -rA tests/test_guard_cuda.py
  _c ep8_rpd4_relay2_c4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 \
    TOPOEP_GPU_RELAY_CHUNKS=4 timeout -k 10 280 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
  _c audit_ep8_rpd4_relay2_c4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 \
    TOPOEP_GPU_RELAY_CHUNKS=4 timeout -k 10 150 python3 tools/sync_audit.py
}

step_relay_nic() {  # the NIC tree of the relay trees (the remote domains' first copies below the home as a heap of
  # fanout children, topoep.relay): the guard kernel's trees and two of its four bit-equality chunks
  # (csrc/relay_tree.cuh on the GPU against the reference, 4 domains and more among the plans), then backend cuda's
  # GPU tests at EP 8 as 4 domains of 2 (ranks sharing the GPU), where a third domain's root fetches from another
  # root: trees of 1 (a NIC chain) level by level, trees of 2 copy by copy (the widened table of children of the
  # copy-by-copy return). Correctness only. Whole pytest logs into $OUT/relay_nic/
  mkdir -p "$OUT/relay_nic"
  _n() { local name=$1 limit=$2 vars=$3; shift 3  # _n NAME SECONDS "VAR=value ..." PYTEST_ARGS...
    env $vars timeout -k 10 "$limit" python3 -m pytest -v -rA --durations=6 "$@" > "$OUT/relay_nic/$name.log" 2>&1
    local rc=$?; echo "$name: rc=$rc $(tail -1 "$OUT/relay_nic/$name.log")"; return $rc; }
  local first="relayed_replicas or no_host_sync or matches_torch"
  _n guard_relay 240 "" tests/test_guard_cuda.py::test_relay_trees_kernel_equals_reference \
    "tests/test_guard_cuda.py::test_guard_kernel_equals_reference[0]" "tests/test_guard_cuda.py::test_guard_kernel_equals_reference[1]"
  _n ep8_rpd2_relay1_levels 280 "TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=2 TOPOEP_GPU_RELAY=1" \
    -x tests/test_cuda_backend_gpu.py -k "$first"
  _n ep8_rpd2_relay2_async 280 \
    "TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=2 TOPOEP_GPU_RELAY=2 TOPOEP_GPU_RELAY_SCHEDULE=async" \
    -x tests/test_cuda_backend_gpu.py -k "$first"
}

step_decision() {  # the decision's fixed costs: the guard's statistics and the spread gate's update on the metadata's
  # side stream (moe.py GuardOutcome), the executed plan's relay trees from the guard kernel's own launches, topoep_plus
  # planned alone on one NVLink domain. DECISION_PART=1: the guard kernel's tests (the bit-equality chunks 2 3, the
  # trees kernel, no host sync and graph replay; chunks 0 1 run in step relay_nic), then the decision's time against
  # the same run's baselines (bench/guard_latency.py: domains of 8, and one domain at EP 16-64 ->
  # guard_latency_one_domain); DECISION_PART=2: backend cuda's GPU tests at EP 1 and at EP 8 (ranks sharing the GPU) as
  # 2 domains of 4 with relay trees of 2 copy by copy and as one domain, with the sync audits. Short logs into
  # $OUT/decision/
  mkdir -p "$OUT/decision"
  _d() { short_log decision "$@"; }
  if [ "${DECISION_PART:-1}" = 1 ]; then
    _d guard_kernel timeout -k 10 300 python3 -m pytest -q -rA tests/test_guard_cuda.py tests/test_bench_guard_latency.py \
      -k "not (equals_reference and (0 or 1))" || { echo "guard kernel tests failed: no benchmark"; return 1; }
    timeout 200 python3 bench/guard_latency.py --out "$OUT" 2>&1 | grep -E "^\||Error" | tail -16
    timeout 150 python3 bench/guard_latency.py --eps 16 32 64 --rpd 64 --name guard_latency_one_domain --out "$OUT" \
      2>&1 | grep -E "^\||Error" | tail -16
  fi
  if [ "${DECISION_PART:-2}" = 2 ]; then
    local ep8="TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 TOPOEP_GPU_RELAY_SCHEDULE=async"
    _d ep1 TOPOEP_GPU_WORLD=1 timeout -k 10 200 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
    env TOPOEP_GPU_WORLD=1 timeout -k 10 90 python3 tools/sync_audit.py > "$OUT/decision/audit_ep1.log" 2>&1
    audit_summary audit_ep1 $? "$OUT/decision/audit_ep1.log"
    _d ep8_rpd4_relay2_async $ep8 timeout -k 10 200 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py \
      -k "relay or guarded or matches_torch or capacity"
    env $ep8 timeout -k 10 90 python3 tools/sync_audit.py > "$OUT/decision/audit_ep8.log" 2>&1
    audit_summary audit_ep8_rpd4_relay2_async $? "$OUT/decision/audit_ep8.log"
    _d ep8_one_domain TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RELAY=2 timeout -k 10 120 python3 -m pytest -q -rA \
      tests/test_cuda_backend_gpu.py -k "guarded_topoep_plus or matches_torch"
  fi
}

step_plan_domain() {  # a large NVLink domain planned as groups (LayerConfig.plan_domain, topoep.solve's plan_domain):
  # the CUDA planner on the groups against the reference (one domain of 64 as groups of 8, of 32 as groups of 16, 2
  # domains of 16 as groups of 4; no host sync, graph replay), backend cuda's guarded topoep_plus at EP 8 as one domain
  # planned as 2 groups of 4 against backend torch (ranks sharing the GPU) and its sync audit, then the planner's and
  # the decision's time on one domain of 16-64 ranks planned as groups of 8, beside the same run's whole-domain
  # decision. Short logs into $OUT/plan_domain/
  mkdir -p "$OUT/plan_domain"
  _p() { short_log plan_domain "$@"; }
  _p planner timeout -k 10 200 python3 -m pytest -q -rA tests/test_planner_cuda.py -k plan_domain
  _p ep8_one_domain TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 timeout -k 10 150 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py -k "groups_alike or keeps_the_same_candidate"
  timeout 200 python3 bench/planner_latency.py --rpd 64 --eps 16 32 64 --plan-domain 8 --runs 100 \
    --name planner_latency_one_domain_groups8 --out "$OUT" 2>&1 | grep -E "^\||Error" | head -8
  timeout 200 python3 bench/guard_latency.py --eps 16 32 64 --rpd 64 --plan-domain 8 --runs 100 \
    --name guard_latency_one_domain_groups8 --out "$OUT" 2>&1 | grep -E "^\||Error" | tail -6
}

step_relay_async() {  # relayed copies moved copy by copy (LayerConfig.relay_schedule=async, transport peer):
  # part 1: backend cuda's GPU tests at EP 8 as 2 domains of 4 (ranks sharing the GPU) with trees of 2: the
  # relayed-vs-direct test (the async runs of fanout 1-3, bit for bit against level by level), the no-host-sync test
  # and the layer against backend torch first (-x: stop at the first failure), then the rest; part 2: the guard kernel's tests (copy-by-copy pricing,
  # the duty-ordered trees; GUARD_CHUNKS picks the parts of the bit-equality test, default all four), the prefetch
  # bank with fetch_overlap, and the sync audit. RELAY_ASYNC_PART=1 or 2 runs one part (one device call each);
  # ASYNC_REST=0 leaves part 1's other tests out.
  # Correctness only. Whole pytest logs (verbose, slowest tests) into $OUT/relay_async/ as they run, so a run cut
  # short still shows how far it got
  mkdir -p "$OUT/relay_async"
  local ep8="TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 TOPOEP_GPU_RELAY_SCHEDULE=async"
  _a() { local name=$1 limit=$2 vars=$3; shift 3  # _a NAME SECONDS "VAR=value ..." PYTEST_ARGS...
    env $vars timeout -k 10 "$limit" python3 -m pytest -v -rA --durations=6 -o faulthandler_timeout=$((limit - 20)) "$@" \
      > "$OUT/relay_async/$name.log" 2>&1
    local rc=$?; echo "$name: rc=$rc $(tail -1 "$OUT/relay_async/$name.log")"; return $rc; }
  if [ "${RELAY_ASYNC_PART:-1}" = 1 ]; then
    local first="relayed_replicas or no_host_sync or matches_torch"
    _a ep8_rpd4_relay2_async_first 300 "$ep8" -x tests/test_cuda_backend_gpu.py -k "$first" || return 1
    [ "${ASYNC_REST:-1}" = 1 ] && _a ep8_rpd4_relay2_async_rest 260 "$ep8" tests/test_cuda_backend_gpu.py -k "not ($first)"
  fi
  if [ "${RELAY_ASYNC_PART:-2}" = 2 ]; then
    local chunks="" c
    # the guard kernel's bit-equality in chunks of seeds (each 30-60 s with the GPU reference's launches): 0 1 here,
    # 2 3 with step guard, so each call stays within the device's 600 s
    for c in ${GUARD_CHUNKS:-0 1}; do chunks="$chunks tests/test_guard_cuda.py::test_guard_kernel_equals_reference[$c]"; done
    _a guard_kernel 230 "" -x $chunks tests/test_guard_cuda.py::test_relay_trees_kernel_equals_reference \
      tests/test_guard_cuda.py::test_no_host_synchronisation_and_graph_replay
    _a ep8_rpd4_relay2_async_prefetch_overlap 260 "$ep8 TOPOEP_GPU_PREFETCH=1 TOPOEP_GPU_FETCH_OVERLAP=1" \
      tests/test_cuda_backend_gpu.py -k "relay or share_the_slots or matches_torch"
    [ "${ASYNC_AUDIT:-1}" = 1 ] || return 0
    env $ep8 timeout -k 10 90 python3 tools/sync_audit.py > "$OUT/relay_async/audit_ep8_rpd4_relay2_async.log" 2>&1
    audit_summary audit $? "$OUT/relay_async/audit_ep8_rpd4_relay2_async.log"
  fi
}

step_fetch_overlap() {  # the forward fetch beside the dispatch (LayerConfig.fetch_overlap): backend cuda's GPU tests
  # with it at EP 1, at EP 8 as 2 domains of 4 (ranks sharing the GPU) with direct fetches and with relay trees of 2,
  # and the EP 8 sync audit. The two-layer test always adds a run with it whose fetch stream starts ~0.5 s late.
  # Correctness only. Short logs into $OUT/fetch_overlap/
  mkdir -p "$OUT/fetch_overlap"
  _o() { short_log fetch_overlap "$@"; }
  _o ep1 TOPOEP_GPU_FETCH_OVERLAP=1 TOPOEP_GPU_WORLD=1 timeout -k 10 240 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py
  _o ep8_rpd4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_FETCH_OVERLAP=1 \
    timeout -k 10 280 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
  _o ep8_rpd4_relay2 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_FETCH_OVERLAP=1 \
    TOPOEP_GPU_RELAY=2 timeout -k 10 200 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py -k "relay or share"
  _o audit_ep8_rpd4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_FETCH_OVERLAP=1 \
    timeout -k 10 150 python3 tools/sync_audit.py
}

step_spread() {  # the spread planner (csrc/spread.cu): its GPU tests (bit-equal to the reference, no host sync,
  # graph replay, enable flag), at EP 8 as 2 domains of 4 (ranks sharing the GPU) guarded topoep_plus with plus_spread
  # and every policy's layer against backend torch (topoep_plus_spread and _tree alone among them), the sync audit
  # (its third layer has plus_spread) there and at EP 1, then its latency (bench/planner_latency.py --spread ->
  # spread_latency.{md,json}). Short logs into $OUT/spread/
  mkdir -p "$OUT/spread"
  _s() { short_log spread "$@"; }
  _s tests timeout -k 10 300 python3 -m pytest -q -rA tests/test_spread_cuda.py
  _s ep8_rpd4_plus TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 timeout -k 10 300 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py -k "guarded_topoep_plus or layer_matches_torch_backend"
  _s sync_audit_ep8_rpd4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 timeout -k 10 200 \
    python3 tools/sync_audit.py
  _s sync_audit_ep1 TOPOEP_GPU_WORLD=1 timeout -k 10 120 python3 tools/sync_audit.py
  timeout 300 python3 bench/planner_latency.py --spread --runs 100 --out "$OUT" 2>&1 | grep -E "^EP|Error" | tail -8
}

step_peers() {  # the peers' planners (csrc/peers.cu: flexmoe, deepseek) against the reference (tests/test_peers_cuda.py),
  # guarded topoep_plus with plus_peers at EP 8 as 2 domains of 4 (ranks sharing the GPU) on both backends, the sync
  # audit at EP 8, then their latency (bench/planner_latency.py --peers -> peer_latency.{md,json}). Short logs into
  # $OUT/peers/
  mkdir -p "$OUT/peers"
  _p() { short_log peers "$@"; }
  _p tests timeout -k 10 300 python3 -m pytest -q -rA tests/test_peers_cuda.py
  _p ep8_rpd4_plus TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 timeout -k 10 300 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py -k "guarded_topoep_plus"
  _p sync_audit_ep8_rpd4 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 timeout -k 10 200 \
    python3 tools/sync_audit.py
  timeout 240 python3 bench/planner_latency.py --peers --runs 100 --out "$OUT" 2>&1 | grep -E "EP|Error" | tail -16
}

step_gate() {  # the spread gate (guard.SpreadGate, LayerConfig.spread_gate): its update kernel against its reference
  # (tests/gate_check.py on the GPU), guarded topoep_plus with plus_spread at
  # EP 8 as 2 domains of 4 (ranks sharing the GPU; the gate's probes carried through the metadata graph's replays),
  # direct and with relay trees of 2, then the decision's time in the metadata (bench/guard_latency.py ->
  # guard_latency.{md,json}, with the chain of a call the gate leaves the spread planner out of). Short logs into
  # $OUT/gate/
  mkdir -p "$OUT/gate"
  _q() { short_log gate "$@"; }
  _q kernel timeout -k 10 120 python3 tests/gate_check.py cuda
  _q ep8_rpd4_plus TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 timeout -k 10 250 python3 -m pytest -q -rA \
    tests/test_cuda_backend_gpu.py -k guarded_topoep_plus
  _q ep8_rpd4_relay2_plus TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 timeout -k 10 250 \
    python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py -k guarded_topoep_plus
  timeout 200 python3 bench/guard_latency.py --out "$OUT" 2>&1 | grep -E "^\||Error" | tail -12
}

step_guard() {  # the guard's kernel (csrc/guard.cu) against its reference (tests/test_guard_cuda.py), then its time
  # in a layer call's metadata beside the reference's (bench/guard_latency.py: without relays and with the
  # relayed-or-direct choice and the relay trees), then the layer on it: backend cuda's GPU tests at EP 1 and their sync audit, and the
  # EP 8 relayed layer (2 domains of 4, ranks sharing the GPU) with its sync audit. Needs the extension (build/ext).
  # GUARD_LAYER=0 leaves the layer runs out, GUARD_KERNEL=0 the kernel's tests and bench. Short logs into $OUT/guard/
  mkdir -p "$OUT/guard"
  _g() { short_log guard "$@"; }
  if [ "${GUARD_KERNEL:-1}" = 1 ]; then
    # GUARD_TESTS=0: the latency alone (after relay_async part 2 ran the bit-equality's chunks 0 1: GUARD_TEST_K
    # selects what runs here, by default the other chunks and every other test of the file)
    if [ "${GUARD_TESTS:-1}" = 1 ]; then
      _g kernel_tests timeout -k 10 300 python3 -m pytest -q -rA tests/test_guard_cuda.py tests/test_worth_triton.py \
        -k "${GUARD_TEST_K:-not (equals_reference and (0 or 1))}" \
        || { echo "guard kernel tests failed: no benchmark"; return 1; }
    fi
    timeout 240 python3 bench/guard_latency.py --out "$OUT" 2>&1 | grep -v -i warn | tail -12
  fi
  [ "${GUARD_LAYER:-1}" = 0 ] && return
  _g ep1 TOPOEP_GPU_WORLD=1 timeout -k 10 280 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py \
    tests/test_runtime_gpu.py
  _g audit_ep1 TOPOEP_GPU_WORLD=1 timeout -k 10 150 python3 tools/sync_audit.py
  _g ep8_rpd4_relay2 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 timeout -k 10 280 \
    python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py
  _g audit_ep8_rpd4_relay2 TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4 TOPOEP_GPU_RELAY=2 timeout -k 10 150 \
    python3 tools/sync_audit.py
}

step_memory() {  # one MoE layer, Qwen3 expert shape, per-rank memory at EP 1, 2, 4, 8 (EPS), the ranks sharing the
  # GPU(s): backend torch, backend cuda with worst-case buffers and with the capacity, beside the memory model
  # (bench/layer_memory.py; the json of each EP size into $OUT/layer_memory.tgz)
  local ep
  mkdir -p "$RUNS-memory"
  for ep in ${EPS:-1 2 4 8}; do
    timeout ${MEMORY_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc_per_node=$ep \
      bench/layer_memory.py --share-gpu --out "$RUNS-memory" > "$RUNS-memory.log" 2>&1
    echo "EP $ep: exit $?"; grep -E "^EP |Error|error" "$RUNS-memory.log" | tail -14
  done
  tar -C "$RUNS-memory" -czf "$OUT/layer_memory.tgz" .
}

step_capacity() {  # the capacity step and the spill path: the CUDA fit against the reference (and solve with a
  # capacity, no host sync, graph replay), the spill kernels against their references, the quick planner set (the
  # extension holds the planner too), then backend cuda's GPU tests and sync audit at EP 1 and with the ranks
  # sharing the GPU at EP 2 (one domain; 2 domains of 1); EP 8: step capacity_ep8. Correctness only. Every whole
  # log into $OUT/capacity_logs.tgz.
  local logs=$RUNS-capacity
  mkdir -p "$logs"
  timeout 400 python3 -m pytest -q -rA tests/test_capacity_cuda.py tests/test_spill.py > "$logs/capacity_tests.log" 2>&1
  echo "capacity kernel + spill kernels: $(tail -1 "$logs/capacity_tests.log")"
  PLANNER_QUICK=1 PLANNER_BENCH=0 step_planner > /dev/null 2>&1
  cp "$OUT/planner_tests_full.log" "$logs/"; rm -f "$OUT"/planner_tests*.log
  echo "planner (quick set): $(tail -1 "$logs/planner_tests_full.log")"
  TOPOEP_GPU_WORLD=1 timeout 300 python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py tests/test_weighting.py \
    > "$logs/cuda_backend_ep1_tests.log" 2>&1
  echo "EP 1: $(tail -1 "$logs/cuda_backend_ep1_tests.log")"
  TOPOEP_GPU_WORLD=1 timeout 120 python3 tools/sync_audit.py > "$logs/sync_audit_ep1.log" 2>&1
  grep -E "synchronising|Error" "$logs/sync_audit_ep1.log" | sed 's/^/EP 1 /'
  (
    export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=2
    shared_tests ep2_rpd2 TOPOEP_GPU_RPD=2
    cp "$RUNS.shared" "$logs/cuda_backend_shared_ep2_rpd2_tests.log"
    shared_tests ep2_rpd1 TOPOEP_GPU_RPD=1
    cp "$RUNS.shared" "$logs/cuda_backend_shared_ep2_rpd1_tests.log"
    shared_audit sync_audit_capacity.log TOPOEP_GPU_RPD=2
    cp "$RUNS.audit" "$logs/sync_audit_ep2.log"
  )
  rm -f "$OUT"/cuda_backend_shared_*_tests.log
  tar -C "$logs" -czf "$OUT/capacity_logs.tgz" .
}

step_capacity_ep8() (  # backend cuda's GPU tests and sync audit at EP 8 as 2 domains of 4, the ranks sharing the GPU
  export TOPOEP_GPU_SHARE=1 TOPOEP_GPU_WORLD=8 TOPOEP_GPU_RPD=4
  shared_tests ep8_rpd4
  shared_audit sync_audit_capacity.log
)

step_capacity_time() {  # one MoE layer at EP 1 on backend cuda, worst-case buffers and the capacity in one run
  # (static and topoep, 4096 and 16384 tokens, uniform and skew -4): the capacity must cost nothing measurable
  timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node=1 bench/moe_layer.py --name \
    moe_layer_capacity_ep1 --out "$OUT" --backends cuda --no-megatron --capacity-factors default none \
    --tokens 4096 16384 --skews 0 -4 --layouts random --profile-iters 0 2>&1 | grep -E "^  [0-9]|Error|error" | tail -20
}

step_moe_layer() {  # one MoE layer, Qwen3 expert shape, EP = all GPUs: backend torch static/topoep (guard on) and
  # megatron's alltoall layer on the same routing: router_skew 0/-2/-4 x (random, concentrated) + the balanced bound,
  # 4096/8192/16384 tokens per rank; Fig. 15 breakdown. About 3 min on 2 H200 (TOKENS=4096: about a third).
  # Uses the CUDA planner (carry build/ext, as for `planner`). Writes $OUT/moe_layer.{md,json}.
  timeout 540 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py --out "$OUT" \
    ${TOKENS:+--tokens $TOKENS} 2>&1 | grep -v -i warn | tail -80
}

step_eval() {  # paper section 6 (bench/paper_eval.py): FIGS (default fig12) on all GPUs, resumable across sessions:
  # the runs go to EVAL_RUNS (default runs/eval in the checkout; carry it to the next session to resume) and are
  # copied back as $OUT/eval-runs.tgz; EVAL_ARGS passes more flags (e.g. --skews natural -4 --layouts megatron)
  local runs=${EVAL_RUNS:-$TOPOEP_ROOT/runs/eval}
  for fig in ${FIGS:-fig12}; do
    timeout ${EVAL_TIMEOUT:-560} python3 bench/paper_eval.py $fig --resume --runs "$runs" --out "$OUT" ${EVAL_ARGS:-} \
      2>&1 | grep -v -i warn | tail -60
  done
  tar -C "$(dirname "$runs")" --exclude='*.pt' -czf "$OUT/eval-runs.tgz" "$(basename "$runs")" 2>/dev/null
}

step_eval_rest() {  # follow-up section-6 runs, PARTS (default the first three; each is several minutes, so one or
  # two per device call): "repeats" = qwen3 around the single-run misses, 3 interleaved runs each; "glm45air" /
  # "deepseekv2" = Fig. 12 at reduced depth (1 dense + 2 MoE layers); "fig16repeats"; "fig16cuda" / "fig16a2a" =
  # Fig. 16 on backend cuda (peer / a2a transport) at 1 rank per domain; "torchprobe" (results/fig12_torch_balanced_rpd2)
  local runs=${EVAL_RUNS:-$TOPOEP_ROOT/runs/eval}
  for part in ${PARTS:-repeats glm45air deepseekv2}; do
    if [ "$part" = fig16repeats ]; then  # fig16's slow balanced runs (backend torch, 1 rank per domain): noise or not?
      timeout 330 python3 bench/paper_eval.py fig16 --resume --runs "$runs-fig16repeats" --out "$OUT/fig16repeats" \
        --backend torch --ranks-per-domain 1 --policies static topoep --layouts megatron --repeats 2 --steps 25 \
        --warmup 5 2>&1 | grep -E "^  \[|met|MISSED|spread"
    elif [ "$part" = fig16cuda ] || [ "$part" = fig16a2a ]; then  # Fig. 16 on backend cuda, 2 GPUs as 2 domains:
      # peer pointers (fig16cuda) or the NVSHMEM transport that real RDMA takes (fig16a2a); every policy
      local tr=peer; [ "$part" = fig16a2a ] && tr=a2a
      timeout 500 python3 bench/paper_eval.py fig16 --resume --runs "$runs" --out "$OUT/$part" --name "$part" \
        --transport $tr --ranks-per-domain 1 --steps 25 --warmup 5 2>&1 | grep -E "^  \[|met|MISSED|Error"
    elif [ "$part" = torchprobe ]; then  # backend torch: static at skew -4 vs megatron's balanced routing
      timeout 200 python3 bench/paper_eval.py fig12 --runs "$runs-probe" --out "$OUT/torchprobe" \
        --name fig12_torch_balanced_rpd2 --backend torch --ranks-per-domain 2 --policies static --skews -4 \
        --layouts megatron --steps 20 --warmup 5 2>&1 | grep -E "^  \[|Error"
    elif [ "$part" = repeats ]; then
      timeout 330 python3 bench/paper_eval.py fig12 --resume --runs "$runs-repeats" --out "$OUT/repeats" --skews 0 -1 -4 \
        --layouts megatron --policies static topoep --repeats 3 --steps 25 --warmup 5 2>&1 | grep -E "^  \[|met|MISSED|spread"
    else  # deepseekv2 at sequence 4096 runs out of memory in its unfused MLA attention (128 heads): 2048
      local seq=; [ "$part" = deepseekv2 ] && seq=trainer.seq_length=2048
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 540 python3 bench/paper_eval.py fig12 --resume \
        --runs "$runs" --out "$OUT/$part" --model "$part" --set model.num_layers=3 $seq --skews natural 0 -2 -4 \
        --steps 25 --warmup 5 2>&1 | grep -E "^  \[|met|MISSED|Error"
    fi
  done
  tar -C "$(dirname "$runs")" --exclude='*.pt' -czf "$OUT/eval-runs.tgz" "$(basename "$runs")" "$(basename "$runs")-repeats" \
    "$(basename "$runs")-fig16repeats" "$(basename "$runs")-probe" 2>/dev/null
}

step_scale() {  # issue 10: EP = all GPUs as 2 virtual domains (nvidia-h200-x8: 2 domains of 4; on 2 GPUs: 2 of 1);
  # PARTS (default all; one or two per device call): tests, layer, fig12, fig13, fig16. Reports named *_ep<NGPU>.
  local rpd=$((NGPU / 2)) runs=${EVAL_RUNS:-$TOPOEP_ROOT/runs/eval}
  local common="--resume --runs $runs --out $OUT --ranks-per-domain $rpd --steps 25 --warmup 5"
  for part in ${PARTS:-tests layer fig12 fig13 fig16}; do
    case $part in
      tests) TOPOEP_GPU_WORLD=$NGPU TOPOEP_GPU_RPD=$rpd python3 -m pytest -q -rA tests/test_cuda_backend_gpu.py 2>&1 \
               | tail -12 | tee "$OUT/cuda_backend_tests_ep$NGPU.log" ;;
      layer) timeout 400 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py \
               --name "moe_layer_ep$NGPU" --out "$OUT" --ranks-per-domain $rpd --tokens 4096 16384 2>&1 | grep -v -i warn \
               | tail -40 ;;
      fig12) timeout 560 python3 bench/paper_eval.py fig12 $common --name "fig12_ep$NGPU" --skews natural 0 -2 -4 2>&1 \
               | grep -E "^  \[|met|MISSED|Error" ;;
      fig13|fig16) timeout 560 python3 bench/paper_eval.py $part $common --name "${part}_ep$NGPU" 2>&1 \
               | grep -E "^  \[|met|MISSED|Error" ;;
    esac
  done
  tar -C "$(dirname "$runs")" --exclude='*.pt' -czf "$OUT/eval-runs.tgz" "$(basename "$runs")" 2>/dev/null
}

step_fig15() {  # Fig. 15: one MoE layer's breakdown by phase, forward and backward (bench/moe_layer.py --name fig15)
  timeout ${FIG15_TIMEOUT:-300} python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py \
    --name fig15 --out "$OUT" --tokens ${TOKENS:-8192} --skews -4 --profile-iters 5 2>&1 | grep -v -i warn | tail -30
}

step_fig16_layer() {  # why topoep on backend torch at 1 rank per domain (fig16) ran slower than static with the guard
  # firing: one MoE layer at skew -4 on that configuration, phases timed (bench/moe_layer.py --name fig16_layer)
  timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" bench/moe_layer.py \
    --name fig16_layer --out "$OUT" --tokens 4096 --skews -4 --backends torch --ranks-per-domain 1 --no-megatron \
    --profile-iters 5 2>&1 | grep -v -i warn | tail -30
}

step_train() {  # model=qwen3 (paper's 5 MoE layers), EP = all GPUs, 50 steps, eplb none vs topoep
  for eplb in none topoep; do
    python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py model=qwen3 trainer=default \
      eplb=$eplb trainer.steps=${STEPS:-50} trainer.run_dir=$RUNS/qwen3-$eplb "$@" > "$RUNS-qwen3-$eplb.log" 2>&1
    echo "== qwen3 eplb=$eplb: exit $?"; grep -E "^world|^step|Error|error" "$RUNS-qwen3-$eplb.log" | tail -8
    cp "$RUNS/qwen3-$eplb/metrics.jsonl" "$OUT/qwen3-$eplb-metrics.jsonl" 2>/dev/null
    grep -E "^world|^step|W&B|Error" "$RUNS-qwen3-$eplb.log" > "$OUT/qwen3-$eplb.log"
  done
  tar -C "$RUNS/qwen3-topoep" -czf "$OUT/qwen3-topoep-wandb.tgz" wandb heatmaps config.yaml 2>/dev/null
}

step_train_backends() {  # model=qwen3, STEPS (default 20) steps: eplb=none (megatron), topoep on backend torch, on cuda
  for run in none:torch topoep:torch topoep:cuda; do
    eplb=${run%%:*}; be=${run##*:}
    timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$NGPU" train.py model=qwen3 trainer=default \
      eplb=$eplb eplb.backend=$be trainer.steps=${STEPS:-20} logger=none trainer.run_dir=$RUNS/qwen3-$eplb-$be \
      > "$RUNS-qwen3-$eplb-$be.log" 2>&1
    echo "== qwen3 eplb=$eplb backend=$be: exit $?"; grep -E "^world|^step|Error|error" "$RUNS-qwen3-$eplb-$be.log" | tail -4
    grep -E "^world|^step|Error" "$RUNS-qwen3-$eplb-$be.log" > "$OUT/qwen3-$eplb-backend-$be.log"
  done
}

step_pp() {  # pipeline parallelism 2 (the paper's GLM/DeepSeek-V2 setting), depth reduced to fit 2 GPUs
  timeout 420 python3 -m torch.distributed.run --standalone --nproc_per_node=2 train.py model=glm45air \
    model.num_layers=2 parallel.pp=2 trainer=default eplb=topoep trainer.steps=10 logger=none \
    trainer.run_dir=$RUNS/glm-pp2 > "$RUNS-glm-pp2.log" 2>&1
  echo "== glm45air pp=2: exit $?"; grep -E "^world|^step|Error|error" "$RUNS-glm-pp2.log" | tail -6 | tee "$OUT/glm-pp2.log"
}

fail=0
for s in "$@"; do echo "##### $s"; "step_$s" || { echo "##### $s: failed"; fail=1; }; done
exit $fail
