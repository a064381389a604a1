export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.
python3 -m pip install --no-build-isolation --no-deps -e . -q > /dev/null 2>&1
for spec in 16384x4096x14336x1 16384x4096x14336x8 65536x2048x768x1 65536x2048x768x128; do
  timeout 110 ncu --clock-control none -k regex:scaled_ragged -c 1 --section SpeedOfLight \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section ComputeWorkloadAnalysis \
    python3 benchmarks/results/2026-11-30-h200/one_grouped.py $spec > $OUT/ncu_$spec.txt 2>&1; echo "$spec rc=$?"
  grep -E "Duration|SM Frequency|DRAM Throughput|L2 Hit Rate|L1/TEX Hit|Memory Throughput|Compute \(SM\) Throughput|L2 Cache Throughput|Executed Ipc Active|Warp Cycles Per Issued|Stall|Mem Busy|Max Bandwidth|Issue Slots Busy" $OUT/ncu_$spec.txt | head -24
done
