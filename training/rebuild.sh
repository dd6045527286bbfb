#!/usr/bin/env bash
# Rebuild the bundled model (assets/dspark-small) from nothing: corpus, tokenizer, trunk,
# greedy draft data, DSpark draft, export (docs/architecture.md §9). The exact recipe of the committed assets.
#
#     bash training/rebuild.sh            # ~3 h on the 2-core CPU box; every stage resumable
#     OUT=/tmp/dspark-small bash training/rebuild.sh
#     RECIPE=v3 bash training/rebuild.sh  # issue 19's stronger model: the stages made so far
#
# Each stage skips itself when its output exists and resumes from its checkpoint when one
# does, so after a killed session the same command continues. Logs: runs/**/train.log,
# runs/draft/data/v2/*.log. Never run by CI.
#
# Stage times on the 2-core CPU box (2026-11-29/30): corpus and tokenizer a few minutes (not timed),
# trunk 620 steps ~45 min + 580 steps ~25 min (2 threads), export ~10 s, draft data ~25 min
# (2 processes, ~2.5 s per 64-token sequence each), draft 70 min, confidence head 1.5 min,
# export ~10 s: about 3 h in all. How the committed draft differs from this sequential run:
# its first 22.5 min (3,225 steps) trained while its data was still being generated (the run
# re-reads the shards every 50 steps), then it resumed with all 864 sequences and its
# time-based cosine stretched from 35 to 70 min (a warm restart of the learning rate).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-assets/dspark-small}
STAGE=runs/stage/dspark-small            # the trunk exported with placeholder mtp.* weights
DATA=runs/draft/data/v2
SEQS=${SEQS:-432}                         # greedy sequences per train shard (2 shards: 864 in all)
DRAFT_MINUTES=${DRAFT_MINUTES:-70}
RECIPE=${RECIPE:-v2}                      # v2: the committed assets; v3: see its section below

say() { printf '\n== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

say corpus
[ -f runs/corpus/manifest.json ] || $PY -m training.corpus --out runs/corpus

say tokenizer
[ -f runs/tokenizer/tokenizer.json ] || $PY -m training.tokenizer --corpus runs/corpus --out runs/tokenizer/tokenizer.json

if [ "$RECIPE" = v3 ]; then
  # v3 (issue 19), stages so far. Same corpus and tokenizer as v2 (checked 2026-12-02: both
  # corpus files match CORPUS.md's sha256 and the retrained tokenizer.json is byte-identical
  # to the committed one). The trunk continues the v2 trunk as committed in 645ad09 (its
  # exported folder, dequantised by the loader: held-out loss 3.07 nats read back, the same
  # as recorded) for 2,000 steps of 8 x 256 tokens: 2.46M + 4.10M = 6.55M tokens in all,
  # 2.67x v2. Continuing was chosen over a fresh start because it reaches that token count
  # 1,200 steps sooner. Fresh AdamW moments, hence a 50-step warm-up to a peak lr of 5e-4
  # (a quarter of v2's: a first try at 1e-3 / 20 warm-up steps rose from 3.1 to 4.4 nats
  # training loss over its first 7 steps, and was restarted), then cosine to 5e-5; seed 1 draws windows v2's steps did not see; the
  # last 25 % of the steps train on the stored (fp8 / fp4) weights. Its log's step-0
  # evaluation is the v2 trunk's held-out loss per domain (the 'before').
  # Step time, measured 2026-12-02 at nice 19 while other jobs kept both cores busy (load
  # average ~8): 121-151 s wall per step (its first 212 s: compiling), i.e. days for the run
  # at that load. On idle cores v2's compiled steps took 2.6 s (2 threads), so 2,000 steps
  # plus 20 evaluations take ~1.5-2.5 h of idle CPU. Tokenizing the corpus into the run's
  # data/ and the step-0 evaluation come first (a few minutes on idle cores).
  # As run, from a checkout of 645ad09's assets (runs/ a link to a folder that outlives the
  # checkout; resume: the same module with --run runs/trunk-v3 --resume --threads 2, no other flag):
  #   OMP_WAIT_POLICY=PASSIVE setsid nohup nice -n 19 .venv/bin/python -m training.train_trunk \
  #     --run runs/trunk-v3 --init assets/dspark-small --corpus runs/corpus \
  #     --tokenizer runs/tokenizer/tokenizer.json --steps 2000 --lr 5e-4 --warmup 50 --seed 1 \
  #     --threads 2 >> runs/trunk-v3/train.log 2>&1 < /dev/null &
  # (setsid: the run must outlive the shell that started it; PASSIVE: idle OpenMP threads
  # sleep instead of spinning on a shared machine.)
  V2=runs/v2/assets/dspark-small
  [ -f $V2/config.json ] || { mkdir -p runs/v2 && git archive 645ad09 assets/dspark-small | tar -x -C runs/v2; }
  # Shortened at step 1,410 to 1,820 steps (the resume above): 2.46M + 3.73M = 6.19M tokens,
  # 2.52x v2, still past the issue's 2.5x; its cosine then ends at 1,820 and the stored-weight
  # (QAT) steps begin at 1,365 instead of 1,500.
  say "v3 trunk: the v2 trunk + 1,820 steps (6.19M tokens in all)"
  mkdir -p runs/trunk-v3
  if [ ! -f runs/trunk-v3/final.pt ]; then
    if [ -f runs/trunk-v3/ckpt.pt ]; then $PY -m training.train_trunk --run runs/trunk-v3 --resume --steps 1820 --threads 2
    else $PY -m training.train_trunk --run runs/trunk-v3 --init $V2 --steps 2000 --lr 5e-4 --warmup 50 \
           --seed 1 --threads 2; fi
  fi >> runs/trunk-v3/train.log
  # On idle cores (2 threads, nice 19, paused while benchmarks ran) a step took 4-7 s; the
  # last 434 steps (1,386 -> 1,820) ran in 44 min. Held-out 'all' loss 3.069 -> 2.768 nats.
  # Stage times of the rest (fourth session of 2026-12-02, 2-core box): export 15 s; draft
  # data 14.7 min for the 8,256 train sequences (two processes at 4.7 sequences/s each, part
  # of the time beside a test run) and 40 s for the 256 held-out ones (6.5/s alone);
  # confidence head 1.5 min; export 18 s. The draft: 45 min (10,978 steps) reached a
  # held-out accept rate of 0.683 (h = 0.855 0.865 0.894 0.916 0.922), still rising about a
  # point per 1,000 steps; it was then resumed with --minutes 120 (a warm restart of its
  # time-based cosine, lr back to 3.6e-4), which the default below does not reproduce.
  S3=runs/stage/dspark-small-v3          # the v3 trunk with placeholder mtp.* weights
  D3=runs/draft/data/v3
  SEQS3=${SEQS3:-4128}                   # greedy sequences per train shard (2 shards: 8,256)
  DRAFT3_MINUTES=${DRAFT3_MINUTES:-45}
  say "v3: export the trunk (placeholder draft) for the draft data"
  [ -f $S3/config.json ] || $PY -m training.export --trunk runs/trunk-v3/final.pt --out $S3 \
      --data runs/trunk-v3/data --threads 2
  # Batched generation (64 sequences per trunk pass, fast numerics: a near-tie may pick another
  # greedy token than one-at-a-time generation would, which does not matter for training data).
  # The v2 prompts: domain mix, lengths and document starts as above; seed 0, v3 sequences.
  say "v3: draft data, 2 train shards of $SEQS3 + 256 held-out (batched, 64 sequences a pass)"
  mkdir -p $D3
  gen3() {  # split sequences shard of
    $PY -m training.draft_data --checkpoint $S3 --data runs/trunk-v3/data --out $D3 --split "$1" \
        --sequences "$2" --shard "$3" --of "$4" --prompt-min 4 --prompt-max 64 --new 64 --doc-start 0.5 \
        --batch 64 --numerics fast --resume >> $D3/$1$3.log 2>&1
  }
  gen3 train "$SEQS3" 0 2 & gen3 train "$SEQS3" 1 2 & wait
  gen3 heldout 256 0 1
  # The draft starts from the committed (v2) draft: the v3 trunk continues the v2 trunk, so
  # its tap rows are close to the ones that draft learnt. Step 0's held-out evaluation is that
  # draft against the v3 trunk (the 'before': accept rate 0.318, against 0.679 on the v2
  # trunk's data). As run, a second run at lr 1.5e-3 trained beside this one (one thread
  # each: a step of this small model is mostly Python overhead, so one process uses little
  # more than one core); it trailed at every held-out evaluation (accept rate 0.39 / 0.46 /
  # 0.51 against 0.48 / 0.51 / 0.57 at steps 1,000-3,000) and was stopped at step 3,295.
  say "v3: DSpark draft from the v2 draft, lr 5e-4, ${DRAFT3_MINUTES} min"
  BEST=v3a
  if [ ! -f runs/draft/$BEST/final.pt ]; then
    if [ -f runs/draft/$BEST/ckpt.pt ]; then $PY -m training.train_draft --run runs/draft/$BEST --resume
    else $PY -m training.train_draft --run runs/draft/$BEST --checkpoint $S3 --data "$D3/train_*.pt" \
           --heldout "$D3/heldout_*.pt" --init $V2 --lr 5e-4 --warmup 50 --steps 1000000 \
           --minutes "$DRAFT3_MINUTES" --eval-every 1000; fi
  fi >> runs/draft/$BEST.log 2>&1
  say "v3: kept runs/draft/$BEST; the confidence head toward the greedy match, 1.5 min"
  if [ ! -f runs/draft/v3conf/final.pt ]; then
    if [ -f runs/draft/v3conf/ckpt.pt ]; then $PY -m training.train_draft --run runs/draft/v3conf --resume
    else $PY -m training.train_draft --run runs/draft/v3conf --checkpoint $S3 --data "$D3/train_*.pt" \
           --heldout "$D3/heldout_*.pt" --init runs/draft/$BEST/final.pt --only mtp.2.confidence_head \
           --conf-target match --conf-weight 1.0 --lr 0.003 --warmup 10 --steps 100000 --minutes 1.5 \
           --eval-every 100000 --threads 2; fi
  fi >> runs/draft/v3conf.log
  say "v3: export trunk + draft to $OUT"
  $PY -m training.export --trunk runs/trunk-v3/final.pt --draft runs/draft/v3conf/final.pt --out "$OUT" \
      --data runs/trunk-v3/data --threads 2
  exit 0
fi

say "trunk: 620 steps, then a warm restart of the cosine to 1,200 steps (2.46M tokens)"
mkdir -p runs/trunk
if [ ! -f runs/trunk/final.pt ]; then
  if [ -f runs/trunk/ckpt.pt ]; then $PY -m training.train_trunk --run runs/trunk --resume --threads 2
  else $PY -m training.train_trunk --run runs/trunk --steps 620 --threads 2; fi
fi >> runs/trunk/train.log
if ! grep -q '"done": 1200' runs/trunk/train.log 2>/dev/null; then
  $PY -m training.train_trunk --run runs/trunk --resume --steps 1200 --threads 2 >> runs/trunk/train.log
fi

say "export the trunk (placeholder draft) for the draft data"
[ -f $STAGE/config.json ] || $PY -m training.export --trunk runs/trunk/final.pt --out $STAGE --threads 2

say "draft data: greedy continuations of the exported trunk (2 train shards + 1 held-out)"
mkdir -p $DATA
gen() {  # shard of
  $PY -m training.draft_data --checkpoint $STAGE --out $DATA --split train --sequences "$SEQS" --shard "$1" --of 2 \
      --prompt-min 4 --prompt-max 64 --new 64 --doc-start 0.5 --batch 1 --numerics fast --resume >> $DATA/gen$1.log 2>&1
}
gen 0 & gen 1 &
$PY -m training.draft_data --checkpoint $STAGE --out $DATA --split heldout --sequences 64 \
    --prompt-min 4 --prompt-max 64 --new 64 --doc-start 0.5 --batch 1 --numerics fast --resume >> $DATA/heldout.log 2>&1
wait

mkdir -p runs/draft
say "DSpark draft: random init, ${DRAFT_MINUTES} min; then the confidence head toward the greedy match"
if [ ! -f runs/draft/v2/final.pt ]; then
  if [ -f runs/draft/v2/ckpt.pt ]; then $PY -m training.train_draft --run runs/draft/v2 --resume
  else $PY -m training.train_draft --run runs/draft/v2 --checkpoint $STAGE --data "$DATA/train_*.pt" \
         --heldout "$DATA/heldout_*.pt" --steps 100000 --minutes "$DRAFT_MINUTES" --eval-every 500; fi
fi >> runs/draft/v2.log
if [ ! -f runs/draft/v2conf/final.pt ]; then
  if [ -f runs/draft/v2conf/ckpt.pt ]; then $PY -m training.train_draft --run runs/draft/v2conf --resume
  else $PY -m training.train_draft --run runs/draft/v2conf --checkpoint $STAGE --data "$DATA/train_*.pt" \
         --heldout "$DATA/heldout_*.pt" --init runs/draft/v2/final.pt --only mtp.2.confidence_head \
         --conf-target match --conf-weight 1.0 --lr 0.003 --warmup 10 --steps 100000 --minutes 1.5 \
         --eval-every 100000; fi
fi >> runs/draft/v2conf.log

say "export trunk + draft to $OUT"
$PY -m training.export --trunk runs/trunk/final.pt --draft runs/draft/v2conf/final.pt --out "$OUT" --threads 2
