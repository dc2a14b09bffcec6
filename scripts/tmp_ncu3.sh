source .gpu/env.sh
export TILELANG_CACHE_DIR=/tmp/tlc
timeout 250 ncu --clock-control none --section SourceCounters --section WarpStateStats --import-source no -k regex:sparse_mla_fwd_pair --launch-skip 1 --launch-count 1 -o $OUT/pair python scripts/ncu_targets.py sparse_pair 2>&1 | grep -vE "TileLang|Warning" | tail -3
ncu -i $OUT/pair.ncu-rep --page source --csv --print-source sass > $OUT/pair_sass.csv 2>&1; wc -l $OUT/pair_sass.csv
ncu -i $OUT/pair.ncu-rep --page details > $OUT/pair_details.txt 2>&1; grep -E "Duration|Stall|Warp Cycles" $OUT/pair_details.txt | head
rm -f $OUT/pair.ncu-rep
