#!/usr/bin/env bash
# The one prepared command for a lent GPU machine (the device tool's `run`, one H200, ≈ 3 minutes).
# It runs the project from its working tree, without installing it, under the machine's own python3 and
# torch; pydantic and typer travel as wheels in .whl/ (the device tool's README: `pip download` them for
# Python 3.12 manylinux into .whl/, which .git/info/exclude ignores, and name .whl in `carry`).
# Everything lands in $OUT (8 files, the device tool's most): the machine, the CUDA context (cuda_context.py),
# calibrate's microbenchmarks, gpu_profile.py's rows and table, and a Chrome trace of one Llama-2-7B step.
# Each part has its own time limit, so that one slow part does not take the rest with it.
set -u
export PYTHONUNBUFFERED=1 MEMPLAN_JIT=0
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
# memplan._presets is the top-level presets/ folder (pyproject's package mapping); without an install, a link.
[ -e memplan/_presets ] || ln -s ../presets memplan/_presets
{
    date -u
    nvidia-smi
    python3 -c "import sys, torch; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
} > "$OUT/env.txt" 2>&1
# PARTS chooses what runs (by default the first five): context calibrate optimizer profile trace kernels ring mpt llama core validate cpprofile snapshot
PARTS=${PARTS:-context calibrate optimizer profile trace}
on() { case " $PARTS " in *" $1 "*) return 0;; *) return 1;; esac; }
if on context; then
    echo "== context"; timeout 100 python3 benchmarks/cuda_context.py --out "$OUT/context.json" | tail -40
fi
if on calibrate; then
    echo "== calibrate"
    timeout 70 python3 -m memplan calibrate --gpu h200 --out "$OUT/h200-calibrated.toml" --json > "$OUT/calibrate.json" 2>&1
    tail -3 "$OUT/calibrate.json"
fi
if on optimizer; then
    echo "== optimizer"; timeout 90 python3 benchmarks/optimizer_step.py --model llama-2-7b --layers 16 --out "$OUT/optimizer_steps.json"
fi
if on profile; then
    echo "== gpu_profile"; timeout 300 python3 benchmarks/gpu_profile.py --gpu h200 --rows "$OUT/rows.jsonl"
    cp docs/gpu-profile.md "$OUT/gpu-profile.md"
fi
if on trace; then
    echo "== trace"
    timeout 80 python3 -m memplan profile --model llama-2-7b --seq "${TRACE_SEQ:-2048}" --checkpointing none --attention flash \
        --steps 1 --warmup 1 --torch-trace /tmp/trace.json --json > /tmp/traced.json 2> /tmp/traced.err
    tail -5 /tmp/traced.err; python3 -c "import json; print(json.load(open('/tmp/traced.json'))['time'])"
    [ -f /tmp/trace.json ] && gzip -c /tmp/trace.json > "$OUT/trace.json.gz"
fi
if on kernels; then  # the kernel classes alone at the held-out runs' shapes (benchmarks/hopper_kernels.py)
    echo "== kernels"
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu --format=csv -lms 500 > "$OUT/smi.csv" &
    SMI=$!
    timeout 240 python3 benchmarks/hopper_kernels.py --out "$OUT/kernels.jsonl" --parts "${KERNEL_PARTS:-gemm,elementwise,chains,attention}" --seqs "${KERNEL_SEQS:-1024,2048,4096,8192,16384,32768,65536}" | tail -3
    kill $SMI
fi
if on ring; then  # torch's ring attention, one context-parallel rank on the fake process group (benchmarks/ring_kernels.py)
    echo "== ring"
    timeout 240 python3 benchmarks/ring_kernels.py --out "$OUT/ring.jsonl" --parts "${RING_PARTS:-block,ring,longkv,smallgrid,gather}" 2>&1 | grep -v "^\[rank\|^[12]\. \|^before the output" | tail -30
fi
if on mpt; then  # one eager MPT-1B step (LayerNorm, GELU, learned positions), the held-out run's micro-batch
    echo "== mpt"
    timeout 150 python3 -m memplan profile -m benchmarks/published/mpt-1b.toml --seq 2048 --batch 14 --checkpointing none \
        --attention flash --steps 2 --warmup 1 --json > "$OUT/mpt1b.json" 2> /tmp/mpt.err
    tail -3 /tmp/mpt.err; python3 -c "import json; print(json.load(open('$OUT/mpt1b.json'))['time'])"
fi
if on llama; then  # one eager Llama 3.2 1B step at s 8,192 (RMSNorm, rotary, SwiGLU, GQA as the reference writes them)
    echo "== llama"
    timeout 150 python3 -m memplan profile -m llama-3.2-1b --seq 8192 --batch 2 --checkpointing none \
        --attention flash --steps 2 --warmup 1 --json > "$OUT/llama1b.json" 2> /tmp/llama.err
    tail -3 /tmp/llama.err; python3 -c "import json; print(json.load(open('$OUT/llama1b.json'))['time'])"
fi
if on core; then  # the eager attention core under selective checkpointing, op by op, on CUDA (benchmarks/eager_core_order.py)
    echo "== core"
    timeout 120 python3 benchmarks/eager_core_order.py --device cuda --seq "${CORE_SEQ:-3072}" --json "$OUT/core.json" > "$OUT/core.txt" 2>&1
    grep "^==" "$OUT/core.txt"
fi
if on validate; then  # whole steps whose peaks the CUDA-only attention transients decide (softmax backward's product, FA2's workspace)
    echo "== validate"
    timeout 500 python3 -c "
import json, sys
sys.path.insert(0, '.')
from benchmarks.gpu_profile import run_case
for case in [('llama-2-7b', 3072, 'selective', 'eager'), ('llama-2-7b', 8192, 'full', 'flash'), ('llama-2-7b', 4096, 'selective', 'eager')]:
    r = run_case(*case, 'cuda', 'h200')
    print(json.dumps({k: r.get(k) for k in ('seq', 'checkpointing', 'measured_peak', 'estimated_allocated', 'allocated_error', 'reserved_error', 'estimated_phase')}), flush=True)
    open('$OUT/validate.jsonl', 'a').write(json.dumps(r) + '\n')
"
fi
if on cpprofile; then  # one context-parallel rank's whole CUDA step (torch's ring over the fake process group) against its estimate
    echo "== cpprofile"
    for args in "--cp 4 --cp-rank 0" "--cp 4 --cp-rank 3" "--cp 2 --cp-rank 1 --cp-rotate alltoall"; do
        timeout 150 python3 -m memplan profile -m llama-3.2-1b --seq 65536 --checkpointing full --attention flash $args \
            --steps 1 --warmup 1 --json > /tmp/cp.json 2> /tmp/cp.err
        tail -2 /tmp/cp.err
        python3 -c "
import json; d = json.load(open('/tmp/cp.json')); m, e = d['measured']['memory'], d['estimated']['memory']
row = dict(args='$args', equal=d['diff']['equal'], measured_peak=m['peak'], estimated_peak=e['peak'],
           phase=e['peak_phase'], reserved=m.get('phase_peaks', {}).get('reserved'))
print(json.dumps(row)); open('$OUT/cpprofile.jsonl', 'a').write(json.dumps(row) + '\n')"
    done
fi
if on snapshot; then  # the allocator's history of one case (SNAPSHOT_ARGS: profile's options)
    echo "== snapshot"
    timeout 90 python3 -m memplan profile ${SNAPSHOT_ARGS:---model llama-3.2-1b --seq 2048 --checkpointing full} \
        --steps 1 --warmup 1 --memory-snapshot /tmp/snapshot.pickle --json > /dev/null 2> /tmp/snapshot.err
    tail -3 /tmp/snapshot.err; [ -f /tmp/snapshot.pickle ] && gzip -c /tmp/snapshot.pickle > "$OUT/snapshot.pickle.gz"
fi
ls -la "$OUT"
