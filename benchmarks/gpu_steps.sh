#!/usr/bin/env bash
# One device call, several measured steps, each under its own time limit, everything under $OUT.
#
#   bash benchmarks/gpu_steps.sh env tests:330 fused:90 relu:80 cost1:180
#
# STEP[:SECONDS] runs one step (the default limit is the step's own); steps run in the order given.
# Each step writes $OUT/<step>.log (lines prefixed with the seconds since the step began) and
# appends "<step> rc <code> <seconds> s" to $OUT/times.txt; a step cut by its limit leaves what it
# wrote. At most 8 files come back from a call, so at the end every file but times.txt and env.txt
# is packed into $OUT/steps.tar.gz (logs, JSON rows, databases) and removed.
#
# Inputs that do not travel by themselves are read from the git-ignored .kb/ (carry it):
#   .kb/kb250            the 250 KernelBench problems (a copy of ../shared/kernelbench)
#   .kb/pylib            the serve extra's packages, for the service step (see below)
#   .kb/cuda-l1-streams  issue 16's corpus (a copy of ../shared/corpora/cuda-l1-streams)
#   .kb/ref_plain.jsonl, .kb/ref_tf32.jsonl, .kb/compare.sqlite, .kb/kb_rows.jsonl, .kb/audit.sqlite,
#   .kb/fidelity.json
#                        rows of earlier calls, copied in so finished work is not redone
# Steps: env tests service ref-bf16 containment handover structure fused relu cost1 cost2 cost3 trace inputs acceptance
#        problems_audit ref-plain ref-tf32 stability stability_suite compare fidelity launch demo audit
#        audit_report
set -u
: "${OUT:?set OUT to the folder whose files come back}"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD/src KBV_CACHE_DIR=${KBV_CACHE_DIR:-/tmp/kbvc} PYTHONUNBUFFERED=1
# The device has no index to install from: the serve extra (fastapi, uvicorn, ...) travels as a
# folder made here for the device's Python (3.12; pydantic_core is compiled for one version):
#   pip install --target .kb/pylib --python-version 3.12 --only-binary=:all: \
#       --platform manylinux2014_x86_64 --implementation cp fastapi uvicorn httpx prometheus-client
# and put after src on the path.
[ -d .kb/pylib ] && PYTHONPATH=$PYTHONPATH:$PWD/.kb/pylib
KB=.kb/kb250

stamp() { local s; s=$(date +%s); while IFS= read -r line; do echo "$(( $(date +%s) - s )) $line"; done; }

seed_from_kb() {  # copy an earlier call's rows into $OUT, so the step resumes from them
    [ -f ".kb/$1" ] && [ ! -f "$OUT/$1" ] && cp ".kb/$1" "$OUT/$1"
    return 0
}

step_env() {
    date -u
    git log -1 --format='%h %s' 2>/dev/null
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    env | grep -E '^(TORCH_CUDA_ARCH_LIST|CUDA_HOME)=' || true
}

step_tests() {  # with the KernelBench tree, so tests/gpu/test_gpu_structure.py runs instead of skipping
    KBV_KERNELBENCH=$PWD/$KB python -m pytest -m gpu tests -p no:cacheprovider --timeout 150 -v -rA --durations=30
}

step_containment() {  # the lock squatter and the containment tests: code newer than the last full run
    python -m pytest -m gpu tests/gpu/test_gpu_containment.py "tests/gpu/test_gpu_hacks.py::test_gpu_hack_is_caught[gpu_lock_squatter]" \
        -p no:cacheprovider --timeout 150 -v -rA --durations=10
}

step_handover() {  # issue 13: both CUDA transports, and a candidate under a uid of its own on the GPU
    python -m pytest -m gpu tests/test_handoff.py tests/gpu/test_gpu_containment.py \
        -p no:cacheprovider --timeout 150 -v -rA --durations=10
}

step_structure() {
    KBV_KERNELBENCH=$PWD/$KB python -m pytest -m gpu tests/gpu/test_gpu_structure.py \
        -p no:cacheprovider --timeout 150 -v -rA
}

step_fused() {
    python benchmarks/sketch_cost.py --device cuda --elements 1610612736 --chunk-log2 24 \
        --fused-rows 64 256 1024 --json "$OUT/fused.json"
    python -m pytest -m gpu tests/test_sketch.py -p no:cacheprovider --timeout 120 -v -rA
}

step_relu() {  # KernelBench's 19_ReLU, the reference as the candidate, under verified
    mkdir -p .kb/one
    cp "$KB/level1/19_ReLU.py" .kb/one/19_ReLU.py
    python - <<'EOF'
import sys
sys.path.insert(0, "benchmarks")
from reference_as_candidate import candidate_source
source = open(".kb/one/19_ReLU.py").read()
open(".kb/one/19_ReLU_candidate.py", "w").write(candidate_source(source, False))
EOF
    python -m kbv.cli eval .kb/one/19_ReLU.py .kb/one/19_ReLU_candidate.py --protocol verified \
        --device cuda --out "$OUT/relu.jsonl"
}

step_cost() {  # $1: the part, 1 to 3
    seed_from_kb kb_rows.jsonl
    # Each problem pays its baselines, as a problem's first candidate does: an earlier step of the
    # same warm machine (the audit) had left two of the sample's baselines cached (2026-12-02,
    # results/2026-12-02-h200-cost-and-audit-parts-4-7/).
    rm -rf "$KBV_CACHE_DIR/baselines"
    python benchmarks/verified_cost.py --kernelbench "$KB" --results "$OUT/kb_rows.jsonl" \
        --part "$1/3" --timeout 100
    python benchmarks/verified_cost.py --results "$OUT/kb_rows.jsonl" --report "$OUT/kb_report.json"
}

# TRACE_PROBLEMS: the cost sample's problems to profile request by request (issue 11);
# TRACE_ARGS: more arguments, e.g. "--protocol standard --protocol benchmarks/protocols/x.toml"
step_trace() {
    rm -rf "$KBV_CACHE_DIR/baselines"  # each problem pays its baselines, as in the cost steps
    # shellcheck disable=SC2086
    python benchmarks/request_trace.py --kernelbench "$KB" --out "$OUT/trace.jsonl" --timeout 100 \
        --problems ${TRACE_PROBLEMS:-45_Gemm_Sigmoid_LogSumExp 17_Conv2d_InstanceNorm_Divide 47_Sum_reduction_over_a_dimension 19_ReLU 100_HingeLoss 40_LayerNorm 1_MLP} \
        ${TRACE_ARGS:-}
}

# INPUT_PROBLEMS: the cost sample's problems whose input draws are profiled step by step (issue 11)
step_inputs() {
    # shellcheck disable=SC2086
    python benchmarks/input_cost.py --kernelbench "$KB" --device cuda --kernels --json "$OUT/inputs.jsonl" \
        --problems ${INPUT_PROBLEMS:-94_MSELoss 47_Sum_reduction_over_a_dimension 17_Conv2d_InstanceNorm_Divide 2_ShallowWideMLP}
}

# SERVICE_LIMIT: how many of level 1's problems the service load takes (default 20), beside every
# GPU hack fixture; SERVICE_COLD=1: the service first on a cache of its own (fresh builds compiled
# on the host's cores, baselines measured), then kbv run
step_service() {  # kbv serve under load: verified evaluations per hour, latency, verdicts against kbv run's
    local cold=""
    if [ -n "${SERVICE_COLD:-}" ]; then
        cold="--service-first"
        KBV_CACHE_DIR=$(mktemp -d /tmp/kbvc-cold.XXXX)
        export KBV_CACHE_DIR
    fi
    # shellcheck disable=SC2086
    python benchmarks/service_load.py --device cuda --kernelbench "$KB/level1" --limit "${SERVICE_LIMIT:-20}" \
        --clients 4 --max-queue 8 --timeout 120 --out "$OUT/service.json" $cold
}

step_acceptance() {  # issue 11's target: the bundled GPU candidates and fixtures in <= 5 minutes
    python benchmarks/gpu_acceptance.py --out "$OUT/acceptance"
}

step_problems_audit() {  # issue 11's target: the 250 KernelBench problems audited in <= 6 minutes
    python -m kbv.cli problems audit "$KB" --device cuda --json > "$OUT/problems_audit.jsonl"
}

# REF_LEVEL: the KernelBench level the ref steps sweep (default level1; rows of another level go to
# ref_<plain|tf32>_<level>.jsonl, seeded from .kb/ like level 1's); REF_ARGS: more arguments, e.g.
# "--retry-too-small" on an H200 for the problems an 80 GB card was too small for; REF_TAG: rows of
# their own (ref_<kind>[_<level>]_<tag>.jsonl), e.g. REF_TAG=v11 REF_ARGS=--long-reductions for a
# protocol's new distribution on the problems it applies to, which the finished sweeps' rows skip;
# REF_MATCH: only the level's problems whose file names start with these words, e.g.
# REF_MATCH="38_L1Norm_ 39_L2Norm_" REF_TAG=big (a fresh evaluation of a few, in rows of their own);
# REF_TIMEOUT: seconds one evaluation may take (default 120; 45_Average_Pooling_2D needs 300 on an H100)
step_ref() {  # $1: plain, tf32 or bf16; $2: seconds of budget for new evaluations
    local flag="" level=${REF_LEVEL:-level1} rows="ref_$1.jsonl" dir m
    [ "$1" = tf32 ] && flag="--tf32"
    [ "$1" = bf16 ] && flag="--precision bf16"
    [ "$level" != level1 ] && rows="ref_$1_$level.jsonl"
    [ -n "${REF_TAG:-}" ] && rows="${rows%.jsonl}_${REF_TAG}.jsonl"
    seed_from_kb "$rows"
    dir="$KB/$level"
    if [ -n "${REF_MATCH:-}" ]; then
        dir=$(mktemp -d /tmp/kbv-ref-match.XXXX)
        for m in $REF_MATCH; do cp "$KB/$level/$m"*.py "$dir/"; done
    fi
    # shellcheck disable=SC2086
    python benchmarks/reference_as_candidate.py "$dir" --device cuda $flag \
        --budget-s "$2" --timeout "${REF_TIMEOUT:-120}" --out "$OUT/$rows" ${REF_ARGS:-}
}

step_stability() {  # STABILITY_MATCH=NAME keeps the candidates whose file name contains NAME
    # shellcheck disable=SC2086
    python benchmarks/honest_stability.py --device cuda --runs 3 --kernelbench "$KB/level1" \
        ${STABILITY_MATCH:+--match "$STABILITY_MATCH"} --out "$OUT/stability.jsonl"
}

step_stability_suite() {  # the bundled honest GPU candidates (small kbv problems), 3 fresh-seed runs each
    python benchmarks/honest_stability.py --device cuda --runs 3 --set honest_cuda --set honest_triton \
        --out "$OUT/stability_suite.jsonl"
}

step_compare() {
    seed_from_kb compare.sqlite
    python -m kbv.cli compare --problems .kb/cuda-l1-streams/problems \
        --candidates .kb/cuda-l1-streams/candidates --device cuda --db "$OUT/compare.sqlite"
    # the per-kernel table against the hand-read labels, and the counts (issue 16)
    python benchmarks/corpus_compare.py --manifest .kb/cuda-l1-streams/manifest.json \
        --db "$OUT/compare.sqlite" --markdown "$OUT/compare_table.md" --json "$OUT/compare_table.json"
}

# AUDIT_ARGS: more arguments for both audit steps, e.g. the protocols to compare (default
# standard and verified): AUDIT_ARGS="--protocol verified --protocol my-candidate.toml"
step_audit() {  # issue 17's GPU sample, part after part in one process: stored pairs are not evaluated again
    seed_from_kb audit.sqlite
    local k=1 rc
    while [ "$k" -le 20 ]; do
        python benchmarks/protocol_audit.py --kernelbench "$KB" --device cuda --db "$OUT/audit.sqlite" \
            --parts "$k-20/20" ${AUDIT_ARGS:-}
        rc=$?
        # 100 + K: part K raised; go on from K + 1 in a fresh process (its CUDA context may be broken)
        if [ "$rc" -gt 100 ] && [ "$rc" -le 120 ]; then k=$(( rc - 100 + 1 )); else break; fi
    done
}

step_audit_report() {  # the whole sample's figures from what the store holds (evaluates nothing)
    seed_from_kb audit.sqlite
    python benchmarks/protocol_audit.py --kernelbench "$KB" --device cuda --db "$OUT/audit.sqlite" \
        --report --json "$OUT/audit_report.jsonl" --html "$OUT/audit_report.html" ${AUDIT_ARGS:-}
}

step_fidelity() {  # resumes from .kb/fidelity.json (copy it back from the archive) when a call cut it
    mkdir -p "$OUT/fidelity"
    [ -f .kb/fidelity.json ] && [ ! -f "$OUT/fidelity/fidelity.json" ] && cp .kb/fidelity.json "$OUT/fidelity/"
    python benchmarks/fidelity.py --out "$OUT/fidelity" --ncu --launch-check --resume
}

step_launch() {  # issue 16: only the launch check of each fidelity class (synced, covered, through kbv's recipe)
    mkdir -p "$OUT/fidelity"
    python benchmarks/fidelity.py --out "$OUT/fidelity" --launch-only
}

step_demo() {
    python -m kbv.cli demo --db "$OUT/demo.sqlite" --html "$OUT/demo.html"
}

run_step() {  # $1: name, $2: seconds
    local name=$1 limit=$2 started rc
    started=$(date +%s)
    case "$name" in
        env) step_env > "$OUT/env.txt" 2>&1; rc=$? ;;
        cost1|cost2|cost3)
            export -f step_cost seed_from_kb
            KB=$KB timeout "$limit" bash -c "step_cost ${name#cost}" 2>&1 | stamp > "$OUT/$name.log"
            rc=${PIPESTATUS[0]} ;;
        ref-plain|ref-tf32|ref-bf16)
            export -f step_ref seed_from_kb
            KB=$KB timeout "$limit" bash -c "step_ref ${name#ref-} $(( limit - 60 ))" 2>&1 \
                | stamp > "$OUT/$name.log"
            rc=${PIPESTATUS[0]} ;;
        tests|service|containment|handover|structure|fused|relu|trace|inputs|acceptance|problems_audit|stability|stability_suite|compare|fidelity|launch|demo|audit|audit_report)
            export -f "step_$name" seed_from_kb
            KB=$KB timeout "$limit" bash -c "step_$name" 2>&1 | stamp > "$OUT/$name.log"
            rc=${PIPESTATUS[0]} ;;
        *) echo "unknown step: $name (see the list at the top of $0)" >&2; return 2 ;;
    esac
    echo "$name rc $rc $(( $(date +%s) - started )) s" >> "$OUT/times.txt"
}

default_limit() {
    case "$1" in
        env) echo 30 ;; tests) echo 480 ;; containment) echo 150 ;; handover) echo 150 ;; structure) echo 150 ;; fused) echo 120 ;;
        relu) echo 90 ;; trace) echo 240 ;; inputs) echo 150 ;; acceptance) echo 300 ;; problems_audit) echo 360 ;; cost1|cost2|cost3) echo 180 ;; ref-plain|ref-tf32|ref-bf16) echo 540 ;; service) echo 540 ;;
        stability) echo 540 ;; stability_suite) echo 240 ;; compare) echo 540 ;; fidelity) echo 540 ;; demo) echo 480 ;;
        audit) echo 540 ;; audit_report) echo 120 ;;
        *) echo 60 ;;
    esac
}

pack() {  # everything but times.txt and env.txt into one archive: at most 8 files come back
    local files
    # An earlier run of this script in the same call packed its steps already: unpack them, so the
    # new archive holds both (a second run overwrote the first's rows on 2026-12-07).
    if [ -f "$OUT/steps.tar.gz" ]; then (cd "$OUT" && tar xzf steps.tar.gz && rm steps.tar.gz); fi
    files=$(cd "$OUT" && find . -mindepth 1 -maxdepth 1 ! -name times.txt ! -name env.txt ! -name steps.tar.gz)
    [ -z "$files" ] && return 0
    # shellcheck disable=SC2086
    (cd "$OUT" && tar czf steps.tar.gz $files && rm -rf $files)
}

for spec in "$@"; do
    name=${spec%%:*}
    limit=${spec#*:}
    [ "$limit" = "$spec" ] && limit=$(default_limit "$name")
    run_step "$name" "$limit"
done
pack
cat "$OUT/times.txt" 2>/dev/null
